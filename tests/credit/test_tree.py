"""PORTool tree credit (SPEC §6): loop reference on random trees, invariants, padding."""

import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.credit import tree_credit
from tests.credit.test_grpo import reference_group_normalize

SETTINGS = settings(max_examples=25, deadline=None)
OPTIONS = list(itertools.product(["portool", "max", "avg", "mix2"],
                                 ["theorem", "traj_only", "fork_only", "no_scale"]))


def random_tree(rng, n=6, max_steps=4, shared_roots=False):
    """A tree by partition refinement: trajectories in one block share the node.

    Node ids are shuffled non-negative integers, unique within the query.
    """
    node_id = np.full((n, max_steps), -1)
    lengths = rng.integers(1, max_steps + 1, size=n)
    next_id = 0
    blocks = [list(range(n))] if shared_roots else [[j] for j in range(n)]
    if shared_roots:
        blocks = _split(rng, blocks[0])
    for depth in range(max_steps):
        new_blocks = []
        for block in blocks:
            alive = [j for j in block if lengths[j] > depth]
            if not alive:
                continue
            for j in alive:
                node_id[j, depth] = next_id
            next_id += 1
            new_blocks.extend(_split(rng, alive))
        blocks = new_blocks
    ids = rng.permutation(1000)[: next_id]
    node_id = np.where(node_id >= 0, ids[np.maximum(node_id, 0)], -1)
    step_mask = node_id >= 0
    outcome = rng.choice([-1.0, 0.0, 1.0], size=n)
    fmt = rng.choice([0.0, 0.5, 1.0], size=(n, max_steps))  # discrete: ties happen
    tokens = rng.integers(1, 30, size=(n, max_steps))
    # Copies of a node carry the same values (the rollout guarantees it).
    for j, t in zip(*np.nonzero(step_mask), strict=True):
        first = np.flatnonzero(node_id[:, t] == node_id[j, t])[0]
        fmt[j, t], tokens[j, t] = fmt[first, t], tokens[first, t]
    return node_id, step_mask, outcome, np.where(step_mask, fmt, 0), np.where(step_mask, tokens, 0)


def _split(rng, block):
    """Random partition of a block into 1..3 sub-blocks."""
    if len(block) <= 1:
        return [block]
    labels = rng.integers(0, rng.integers(1, 4), size=len(block))
    return [[j for j, lab in zip(block, labels, strict=True) if lab == k] for k in set(labels)]


def reference_tree(node_id, step_mask, outcome, fmt, tokens, gamma=0.95, b=0.25,
                   rule="portool", weighting="theorem", ddof=1, eps=1e-6):
    """Dictionary-based loop form of SPEC §6.2-6.3 for one query."""
    n, num_steps = node_id.shape
    trajs = [j for j in range(n) if step_mask[j].any()]
    length = {j: int(step_mask[j].sum()) for j in trajs}
    nodes = {}  # node id -> dict(depth, parent, members)
    for j in trajs:
        for t in range(length[j]):
            node = int(node_id[j, t])
            parent = "root" if t == 0 else int(node_id[j, t - 1])
            nodes.setdefault(node, dict(depth=t, parent=parent, members=[]))["members"].append(j)
    children = {}
    for node, info in nodes.items():
        children.setdefault(info["parent"], []).append(node)
    traj_adv = dict(zip(trajs, reference_group_normalize(outcome[trajs], "std", ddof, eps),
                        strict=True))

    def outcome_part(node):
        info = nodes[node]
        return [gamma ** (length[k] - 1 - info["depth"]) * outcome[k] for k in info["members"]]

    def fmt_reward(node):
        info = nodes[node]
        return b * (2 * fmt[min(info["members"]), info["depth"]] - 1)

    reward = {}
    for node in nodes:
        parts = outcome_part(node)
        if rule == "avg":
            reward[node] = np.mean(parts) + fmt_reward(node)
        else:
            reward[node] = max(parts) + fmt_reward(node)
    if rule in ("portool", "mix2"):
        for siblings in children.values():
            if len(siblings) < 2:
                continue
            key = [max(outcome_part(s)) + (fmt_reward(s) if rule == "portool" else 0)
                   for s in siblings]
            if max(key) - min(key) <= 1e-6:
                for s in siblings:
                    reward[s] = np.mean(outcome_part(s)) + fmt_reward(s)
    fork_adv = {}
    for siblings in children.values():
        normalised = reference_group_normalize([reward[s] for s in siblings], "std", ddof, eps)
        fork_adv.update(zip(siblings, normalised, strict=True))
    num_forks = sum(len(c) > 1 for c in children.values())

    step_adv = np.zeros((n, num_steps))
    node_reward = np.zeros((n, num_steps))
    fork = np.zeros((n, num_steps))
    for j in trajs:
        traj_tokens = tokens[j, : length[j]].sum()
        for t in range(length[j]):
            node = int(node_id[j, t])
            info = nodes[node]
            members = info["members"]
            node_tokens = tokens[min(members), t]
            w2 = 0.0
            if fork_adv[node] != 0:
                w2 = len(trajs) * traj_tokens / (
                    len(members) * node_tokens * len(children[info["parent"]]) * num_forks)
            w1, w2 = {"theorem": (1, w2), "traj_only": (1, 0), "fork_only": (0, w2),
                      "no_scale": (1, 1)}[weighting]
            step_adv[j, t] = w1 * np.mean([traj_adv[k] for k in members]) + w2 * fork_adv[node]
            node_reward[j, t] = reward[node]
            fork[j, t] = fork_adv[node]
    traj = np.array([traj_adv.get(j, 0.0) for j in range(n)])
    return dict(step_adv=step_adv, node_reward=node_reward, fork_adv=fork, traj_adv=traj)


def _stack(trees):
    return [np.stack(parts) for parts in zip(*trees, strict=True)]


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.sampled_from(OPTIONS), st.booleans())
def test_matches_loop_reference_on_random_trees(seed, option, shared_roots):
    rule, weighting = option
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, shared_roots=shared_roots) for _ in range(3)]
    with jax.enable_x64(True):
        actual = tree_credit(*_stack(trees), rule=rule, weighting=weighting)
    for q, tree in enumerate(trees):
        expected = reference_tree(*tree, rule=rule, weighting=weighting)
        for field, value in expected.items():
            np.testing.assert_allclose(np.asarray(getattr(actual, field))[q], value,
                                       atol=1e-8, rtol=1e-8, err_msg=f"{field} query {q}")


def test_independent_chains_have_no_fork_advantage_below_the_root():
    """n chains with no shared node: the only fork is the root (SPEC §6.3 property)."""
    rng = np.random.default_rng(0)
    n, num_steps = 5, 4
    node_id = np.arange(n * num_steps).reshape(n, num_steps)
    lengths = np.array([1, 2, 4, 3, 4])
    step_mask = np.arange(num_steps) < lengths[:, None]
    node_id = np.where(step_mask, node_id, -1)
    outcome = np.array([1.0, -1.0, 0.0, 1.0, -1.0])
    out = tree_credit(node_id[None], step_mask[None], outcome[None],
                      rng.random((1, n, num_steps)), np.full((1, n, num_steps), 7))
    fork_adv = np.asarray(out.fork_adv)[0]
    np.testing.assert_array_equal(fork_adv[:, 1:], 0.0)
    assert np.abs(fork_adv[:, 0]).min() > 0  # the root's children differ


def test_padding_steps_and_trajectories_leaves_results_unchanged():
    rng = np.random.default_rng(3)
    tree = random_tree(rng, n=5, max_steps=3)
    base = tree_credit(*[x[None] for x in tree])
    node_id, step_mask, outcome, fmt, tokens = tree
    padded = (
        np.pad(node_id, [(0, 2), (0, 2)], constant_values=-1),
        np.pad(step_mask, [(0, 2), (0, 2)], constant_values=False),
        np.pad(outcome, [(0, 2)], constant_values=1.0),
        np.pad(fmt, [(0, 2), (0, 2)], constant_values=0.7),
        np.pad(tokens, [(0, 2), (0, 2)], constant_values=9),
    )
    out = tree_credit(*[x[None] for x in padded])
    for field in base._fields:
        want = np.asarray(getattr(base, field))[0]
        got = np.asarray(getattr(out, field))[0]
        np.testing.assert_allclose(got[tuple(slice(0, s) for s in want.shape)], want, atol=1e-6)
        assert np.abs(got).sum() == pytest.approx(np.abs(want).sum(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("rule,weighting", [("portool", "theorem"), ("mix2", "fork_only")])
def test_jit_equals_eager(rule, weighting):
    rng = np.random.default_rng(4)
    trees = _stack([random_tree(rng) for _ in range(2)])
    jitted = jax.jit(tree_credit, static_argnames=("rule", "weighting", "gamma", "fmt_bound"))
    a = jitted(*trees, rule=rule, weighting=weighting)
    b = tree_credit(*trees, rule=rule, weighting=weighting)
    for field in a._fields:
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), atol=1e-5)


def test_bad_options_name_the_option():
    tree = [x[None] for x in random_tree(np.random.default_rng(0))]
    with pytest.raises(ValueError, match="rule='best'"):
        tree_credit(*tree, rule="best")
    with pytest.raises(ValueError, match="weighting"):
        tree_credit(*tree, weighting="uniform")
