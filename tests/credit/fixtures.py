"""Small synthetic trajectories with every field the built-in schemes read."""

import numpy as np

from agentrl.types import Trajectory, collate, to_device


def make_trajectory(prompt_id, turns, *, outcome, rng, prompt_len=3, env_len=2, node_ids=None):
    """A rollout of `turns` = [[step token counts of turn 0], [of turn 1], ...].

    Layout: prompt, then per step its policy tokens followed by `env_len`
    environment tokens (tool result / user turn), loss_mask 0.
    """
    tokens, loss_mask, step_id, turn_id = [], [], [], []

    def env(count):
        tokens.extend(rng.integers(100, 200, size=count))
        loss_mask.extend([False] * count)
        step_id.extend([-1] * count)
        turn_id.extend([-1] * count)

    env(prompt_len)
    step = 0
    for turn, steps in enumerate(turns):
        for count in steps:
            tokens.extend(rng.integers(1, 100, size=count))
            loss_mask.extend([True] * count)
            step_id.extend([step] * count)
            turn_id.extend([turn] * count)
            env(env_len)
            step += 1
    num_turns = len(turns)
    max_turn_steps = max(len(s) for s in turns)
    num_items = 3
    return Trajectory(
        prompt_id=prompt_id,
        tokens=np.asarray(tokens),
        loss_mask=np.asarray(loss_mask),
        step_id=np.asarray(step_id),
        turn_id=np.asarray(turn_id),
        rollout_logprobs=-rng.random(len(tokens)) * np.asarray(loss_mask),
        outcome=outcome,
        turn_rewards=rng.random(num_turns),
        node_id=np.arange(step) if node_ids is None else np.asarray(node_ids),
        fmt_score=rng.random(step),
        boundary_values=rng.random(step),
        checklist_sat_after=rng.random((num_turns, max_turn_steps, num_items)) < 0.4,
        checklist_deps=np.tril(rng.random((num_turns, num_items, num_items)) < 0.4, k=-1),
        checklist_weights=np.full((num_turns, num_items), 1.0 / num_items),
        checklist_item_mask=np.ones((num_turns, num_items), bool),
        checklist_step_mask=np.arange(max_turn_steps)[None, :]
        < np.asarray([len(s) for s in turns])[:, None],
        reference_turns=3,
    )


def make_batch(seed=0, *, num_groups=2, group_size=3, values=True):
    """`num_groups × group_size` trajectories, collated and on device."""
    rng = np.random.default_rng(seed)
    trajectories = []
    for group in range(num_groups):
        for member in range(group_size):
            num_turns = int(rng.integers(1, 4))
            turns = [list(rng.integers(1, 5, size=int(rng.integers(1, 3))))
                     for _ in range(num_turns)]
            num_steps = sum(len(t) for t in turns)
            # Tree ids: member m shares its first node with member m - 1 when
            # both exist (a fork below it), otherwise unique.
            node_ids = 100 * member + np.arange(num_steps)
            trajectories.append(make_trajectory(
                f"prompt{group}", turns, outcome=float(rng.choice([-1.0, 0.0, 1.0])), rng=rng,
                node_ids=node_ids,
            ))
    batch = collate(trajectories, group_size=group_size)
    if values:
        batch = batch.replace(values=rng.random(batch.tokens.shape).astype(np.float32))
    return to_device(batch)
