"""Trajectory (host-side, ragged, numpy) and Batch (device-side, padded) (SPEC §1).

A `Trajectory` is one rollout stored token-in/token-out: the token ids the
policy sampled are kept verbatim, environment inserts are appended once as
chat-template deltas with `loss_mask = 0`. `collate` pads a list of
trajectories, grouped by prompt, into a `Batch` whose rows are ordered
`[N × G]` (group n occupies rows `n·G … n·G + G − 1`).

Per-step arrays use the trajectory's global step index (`step_id`); CM2's
checklist arrays are per (turn, step-within-turn), as its paper defines them.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import chex
import flax.struct
import jax.numpy as jnp
import numpy as np

TRAJECTORY_FORMAT_VERSION = 1


@dataclasses.dataclass
class Trajectory:
    """One rollout, host-side and ragged (numpy arrays of its own lengths).

    Attributes:
      prompt_id: the prompt (query) this rollout answers; its group key.
      tokens: `[T]` int token ids, prompt included.
      loss_mask: `[T]` bool, 1 exactly on policy-sampled tokens.
      step_id: `[T]` int, 0-based step of each policy token, −1 elsewhere.
      turn_id: `[T]` int, 0-based turn of each policy token, −1 elsewhere.
      rollout_logprobs: `[T]` float, the engine's log-probabilities of the
        sampled tokens (0 elsewhere).
      outcome: trajectory-level reward (R, R_out, terminal reward, R^F).
      turn_rewards: `[K]` per-turn rewards (MT-GRPO `R^I`, MT-PPO `R^I`).
      node_id: `[S]` PORTool tree node of each step.
      fmt_score: `[S]` PORTool format score of each step.
      checklist_sat_after: `[L, S_turn, C]` bool CM2 judge verdicts.
      checklist_deps: `[L, C, C]` bool CM2 item prerequisites.
      checklist_weights: `[L, C]` CM2 item weights.
      checklist_item_mask: `[L, C]` bool valid items.
      checklist_step_mask: `[L, S_turn]` bool valid steps of each turn.
      reference_turns: turn count of the CM2 reference dialogue.
      boundary_values: `[S]` critic values at the boundary before each step
        (CARL), filled in by the trainer.
      policy_version: the policy step that generated it.
      episode_steps: number of steps of the whole episode when this row holds
        only some of them (a CARL view, `agentrl.rollout.segments`); None:
        the row's own `step_id` tells.
      metadata: free-form (task, judge rationales, tool I/O, ...).
    """

    prompt_id: str
    tokens: np.ndarray
    loss_mask: np.ndarray
    step_id: np.ndarray
    turn_id: np.ndarray
    rollout_logprobs: np.ndarray | None = None
    outcome: float = 0.0
    turn_rewards: np.ndarray | None = None
    node_id: np.ndarray | None = None
    fmt_score: np.ndarray | None = None
    checklist_sat_after: np.ndarray | None = None
    checklist_deps: np.ndarray | None = None
    checklist_weights: np.ndarray | None = None
    checklist_item_mask: np.ndarray | None = None
    checklist_step_mask: np.ndarray | None = None
    reference_turns: int | None = None
    boundary_values: np.ndarray | None = None
    policy_version: int = 0
    episode_steps: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32)
        self.loss_mask = np.asarray(self.loss_mask, bool)
        self.step_id = np.asarray(self.step_id, np.int32)
        self.turn_id = np.asarray(self.turn_id, np.int32)
        length = self.tokens.shape[0]
        for name in ("loss_mask", "step_id", "turn_id", "rollout_logprobs"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != (length,):
                raise ValueError(
                    f"Trajectory {self.prompt_id!r}: {name} has shape {np.shape(value)} but "
                    f"tokens has shape ({length},); every per-token array must match it."
                )
        off_policy = ~self.loss_mask
        if (self.step_id[off_policy] != -1).any() or (self.turn_id[off_policy] != -1).any():
            raise ValueError(
                f"Trajectory {self.prompt_id!r}: step_id/turn_id must be -1 on tokens with "
                "loss_mask 0 (SPEC §1)."
            )
        if (self.step_id[self.loss_mask] < 0).any() or (self.turn_id[self.loss_mask] < 0).any():
            raise ValueError(
                f"Trajectory {self.prompt_id!r}: every policy token needs step_id >= 0 and "
                "turn_id >= 0 (SPEC §1)."
            )

    @property
    def num_steps(self) -> int:
        own = int(self.step_id.max(initial=-1)) + 1
        return own if self.episode_steps is None else max(own, self.episode_steps)

    @property
    def num_turns(self) -> int:
        return int(self.turn_id.max(initial=-1)) + 1


@flax.struct.dataclass
class Batch:
    """A padded device batch of `B = N × G` rows (SPEC §1).

    Optional fields are None when no scheme of the run needs them.

    Attributes:
      tokens: `[B, T]` int32.
      loss_mask: `[B, T]` bool policy tokens.
      step_id: `[B, T]` int32 (−1 off-policy).
      turn_id: `[B, T]` int32 (−1 off-policy).
      row_mask: `[B]` bool, False on padding rows.
      outcome: `[B]` trajectory rewards.
      step_mask: `[B, S]` bool valid steps (global index).
      turn_mask: `[B, K]` bool valid turns.
      rollout_logprobs: `[B, T]` engine log-probabilities.
      turn_rewards: `[B, K]`.
      token_rewards: `[B, T]` rewards already placed on tokens (PPO).
      values: `[B, T]` critic values at tokens (PPO, MT-PPO).
      boundary_values: `[B, S]` critic values at step boundaries (CARL).
      node_id: `[B, S]` int32 PORTool tree nodes (−1 on padding).
      fmt_score: `[B, S]` PORTool format scores.
      checklist_sat_after: `[B, L, S_turn, C]` bool.
      checklist_deps: `[B, L, C, C]` bool.
      checklist_weights: `[B, L, C]`.
      checklist_item_mask: `[B, L, C]` bool.
      checklist_step_mask: `[B, L, S_turn]` bool; a turn was reached iff it has
        a valid step.
      reference_turns: `[B]` reference dialogue turn counts.
      lengths: `[B]` int32 number of real tokens of each row (padding after).
      group_size: G (static).
    """

    tokens: chex.Array
    loss_mask: chex.Array
    step_id: chex.Array
    turn_id: chex.Array
    row_mask: chex.Array
    outcome: chex.Array
    step_mask: chex.Array
    turn_mask: chex.Array
    rollout_logprobs: chex.Array | None = None
    turn_rewards: chex.Array | None = None
    token_rewards: chex.Array | None = None
    values: chex.Array | None = None
    boundary_values: chex.Array | None = None
    node_id: chex.Array | None = None
    fmt_score: chex.Array | None = None
    checklist_sat_after: chex.Array | None = None
    checklist_deps: chex.Array | None = None
    checklist_weights: chex.Array | None = None
    checklist_item_mask: chex.Array | None = None
    checklist_step_mask: chex.Array | None = None
    reference_turns: chex.Array | None = None
    lengths: chex.Array | None = None
    group_size: int = flax.struct.field(pytree_node=False, default=1)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_groups(self) -> int:
        return self.batch_size // self.group_size

    def grouped(self, x: chex.Array) -> chex.Array:
        """`[B, ...]` → `[N, G, ...]`."""
        return x.reshape((self.num_groups, self.group_size, *x.shape[1:]))

    def ungrouped(self, x: chex.Array) -> chex.Array:
        """`[N, G, ...]` → `[B, ...]`."""
        return x.reshape((self.batch_size, *x.shape[2:]))

    def require(self, *names: str, scheme: str) -> None:
        """Raises a ValueError naming the fields a scheme needs and this batch lacks."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"credit scheme {scheme!r} needs Batch fields {missing}, which are None; fill "
                "them in the rollout/reward stage (see agentrl.types.Trajectory) before credit."
            )


def _pad(arrays: Sequence[np.ndarray | None], shape: tuple[int, ...], dtype, fill) -> np.ndarray:
    out = np.full((len(arrays), *shape), fill, dtype)
    for row, value in enumerate(arrays):
        if value is None:
            continue
        value = np.asarray(value)
        if any(have > want for have, want in zip(value.shape, shape, strict=True)):
            raise ValueError(f"array of shape {value.shape} does not fit the padded shape {shape}")
        out[(row, *tuple(slice(0, n) for n in value.shape))] = value
    return out


def _max_len(arrays, axis=0, minimum=1):
    lengths = [np.shape(a)[axis] for a in arrays if a is not None]
    return max([minimum, *lengths])


def collate(
    trajectories: Sequence[Trajectory],
    *,
    group_size: int,
    max_length: int | None = None,
    max_steps: int | None = None,
    max_turns: int | None = None,
) -> Batch:
    """Pads trajectories, already ordered group by group, into a `Batch`.

    Args:
      trajectories: `N × G` trajectories; consecutive runs of `group_size`
        share a prompt.
      group_size: G.
      max_length, max_steps, max_turns: padded sizes T, S, K; default to the
        longest in the list (pass fixed values to avoid recompiles).

    Returns:
      A numpy-backed `Batch` (device_put it, or let jit do it).
    """
    if not trajectories:
        raise ValueError("collate: got no trajectories; pass at least one group.")
    if group_size < 1 or len(trajectories) % group_size:
        raise ValueError(
            f"collate: {len(trajectories)} trajectories do not split into groups of "
            f"group_size={group_size}; pass N × G trajectories ordered group by group."
        )
    for start in range(0, len(trajectories), group_size):
        prompt_ids = {t.prompt_id for t in trajectories[start : start + group_size]}
        if len(prompt_ids) != 1:
            raise ValueError(
                f"collate: rows {start}..{start + group_size - 1} mix prompts {sorted(prompt_ids)};"
                " each group of group_size rows must share one prompt_id."
            )
    length = max_length or _max_len([t.tokens for t in trajectories])
    steps = max_steps or max([1, *(t.num_steps for t in trajectories)])
    turns = max_turns or max([1, *(t.num_turns for t in trajectories)])
    ts = trajectories

    def per_token(name, dtype, fill):
        return _pad([getattr(t, name) for t in ts], (length,), dtype, fill)

    def optional(name, shape, dtype, fill=0):
        values = [getattr(t, name) for t in ts]
        if all(v is None for v in values):
            return None
        return _pad(values, shape, dtype, fill)

    step_counts = [t.num_steps for t in ts]
    turn_counts = [t.num_turns for t in ts]
    batch = dict(
        tokens=per_token("tokens", np.int32, 0),
        loss_mask=per_token("loss_mask", bool, False),
        step_id=per_token("step_id", np.int32, -1),
        turn_id=per_token("turn_id", np.int32, -1),
        row_mask=np.ones(len(ts), bool),
        lengths=np.asarray([min(len(t.tokens), length) for t in ts], np.int32),
        outcome=np.asarray([t.outcome for t in ts], np.float32),
        step_mask=np.arange(steps)[None, :] < np.asarray(step_counts)[:, None],
        turn_mask=np.arange(turns)[None, :] < np.asarray(turn_counts)[:, None],
        rollout_logprobs=optional("rollout_logprobs", (length,), np.float32),
        turn_rewards=optional("turn_rewards", (turns,), np.float32),
        boundary_values=optional("boundary_values", (steps,), np.float32),
        node_id=optional("node_id", (steps,), np.int32, -1),
        fmt_score=optional("fmt_score", (steps,), np.float32),
    )
    checklist = [t.checklist_sat_after for t in ts]
    if any(c is not None for c in checklist):
        turns_l = _max_len(checklist, 0)
        steps_l = _max_len(checklist, 1)
        items = _max_len(checklist, 2)
        batch.update(
            checklist_sat_after=_pad(checklist, (turns_l, steps_l, items), bool, False),
            checklist_deps=optional("checklist_deps", (turns_l, items, items), bool, False),
            checklist_weights=optional("checklist_weights", (turns_l, items), np.float32),
            checklist_item_mask=optional("checklist_item_mask", (turns_l, items), bool, False),
            checklist_step_mask=optional("checklist_step_mask", (turns_l, steps_l), bool, False),
            reference_turns=(
                np.asarray([t.reference_turns for t in ts], np.float32)
                if all(t.reference_turns is not None for t in ts)
                else None
            ),
        )
    return Batch(group_size=group_size, **batch)


def to_device(batch: Batch) -> Batch:
    """Converts every array field of a host `Batch` to a jax array."""
    return batch.replace(
        **{
            f.name: jnp.asarray(getattr(batch, f.name))
            for f in dataclasses.fields(batch)
            if f.name != "group_size" and getattr(batch, f.name) is not None
        }
    )
