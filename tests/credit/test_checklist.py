"""CM2 checklist credit (SPEC §5): loop reference, invariants, padding."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.credit import checklist_credit, checklist_step_rewards
from tests.credit.test_grpo import reference_group_normalize

SETTINGS = settings(max_examples=30, deadline=None)
N, G, L, S, C = 2, 4, 3, 3, 4


def random_checklist(seed):
    """Random inputs: acyclic deps (prerequisites have lower index), prefix masks."""
    rng = np.random.default_rng(seed)
    sat_after = rng.random((N, G, L, S, C)) < 0.35
    deps = np.tril(rng.random((N, G, L, C, C)) < 0.3, k=-1)
    weights = rng.random((N, G, L, C)) + 0.1
    num_items = rng.integers(1, C + 1, size=(N, G, L))
    item_mask = np.arange(C) < num_items[..., None]
    weights = np.where(item_mask, weights, 0.0)
    weights = weights / weights.sum(-1, keepdims=True)
    num_steps = rng.integers(1, S + 1, size=(N, G, L))
    step_mask = np.arange(S) < num_steps[..., None]
    num_turns = rng.integers(1, L + 1, size=(N, G))
    turn_mask = np.arange(L) < num_turns[..., None]
    return sat_after, deps, weights, step_mask, item_mask, turn_mask


def reference_checklist(sat_after, deps, weights, step_mask, item_mask, turn_mask,
                        scale="none", ddof=1, eps=1e-6):
    """Loop form of SPEC §5.2-5.4 over one batch."""
    n_, g_, l_, s_, c_ = sat_after.shape
    r = np.zeros(sat_after.shape)
    r_tilde = np.zeros(sat_after.shape)
    eligible_sets = np.zeros(sat_after.shape, bool)
    for idx in np.ndindex(n_, g_, l_):
        if not turn_mask[idx]:
            continue
        items = [c for c in range(c_) if item_mask[idx][c]]
        steps = [s for s in range(s_) if step_mask[idx][s]]
        sat = {c: False for c in items}
        history = []
        for s in steps:
            eligible = {
                c for c in items
                if not sat[c] and all(sat[d] for d in items if deps[idx][c, d])
            }
            for c in items:
                sat[c] = sat[c] or bool(sat_after[idx][s, c])
            history.append((s, eligible, dict(sat)))
        final = history[-1][2]
        for s, eligible, sat_next in history:
            for c in eligible:
                eligible_sets[idx][s, c] = True
                r[idx][s, c] = float(sat_next[c])
                r_tilde[idx][s, c] = float(final[c])
    turn_reward = np.einsum("ngtsc,ngtc->ngt", r, weights * item_mask)
    traj_reward = turn_reward.sum(-1) / np.maximum(turn_mask.sum(-1), 1)
    traj_adv = np.stack([reference_group_normalize(row, scale, ddof, eps) for row in traj_reward])
    turn_adv = np.zeros((n_, g_, l_))
    step_adv = np.zeros((n_, g_, l_, s_))
    for q in range(n_):
        for t in range(l_):
            members = np.flatnonzero(turn_mask[q, :, t])
            turn_adv[q, members, t] = reference_group_normalize(
                turn_reward[q, members, t], scale, ddof, eps)
            hit = r[q, :, t].max(axis=1)  # [G, C]
            baseline = hit.mean(axis=0)
            denominator = (np.std(hit, axis=0, ddof=ddof) + eps) if scale == "std" else 1.0
            for i in members:
                for s in range(s_):
                    eligible = np.flatnonzero(eligible_sets[q, i, t, s])
                    w = weights[q, i, t, eligible]
                    if len(eligible) == 0 or w.sum() == 0 or g_ <= ddof:
                        continue
                    item_adv = ((r_tilde[q, i, t, s] - baseline) / denominator)[eligible]
                    step_adv[q, i, t, s] = (w * item_adv).sum() / w.sum()
    return dict(r=r, r_tilde=r_tilde, eligible=eligible_sets, turn_reward=turn_reward,
                traj_reward=traj_reward, traj_adv=traj_adv, turn_adv=turn_adv, step_adv=step_adv)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.sampled_from(["none", "std"]))
def test_matches_loop_reference(seed, scale):
    inputs = random_checklist(seed)
    expected = reference_checklist(*inputs, scale=scale)
    actual = checklist_credit(*inputs, scale=scale)
    for field, value in expected.items():
        np.testing.assert_allclose(np.asarray(getattr(actual, field), np.float64), value,
                                   atol=1e-4, rtol=1e-4, err_msg=field)


@SETTINGS
@given(st.integers(0, 2**31 - 1))
def test_each_item_earns_at_most_once_per_turn_and_rewards_in_unit_interval(seed):
    out = checklist_credit(*random_checklist(seed))
    assert np.asarray(out.r).sum(axis=3).max() <= 1.0
    # r̃ backfills every eligible step of a satisfied item, so it may exceed 1 per
    # item and turn; it is 0/1 per step.
    assert set(np.unique(np.asarray(out.r_tilde))) <= {0.0, 1.0}
    turn_reward = np.asarray(out.turn_reward)
    assert turn_reward.min() >= 0.0 and turn_reward.max() <= 1.0 + 1e-6
    traj_reward = np.asarray(out.traj_reward)
    assert traj_reward.min() >= 0.0 and traj_reward.max() <= 1.0 + 1e-6
    # r ≤ r̃: an item earned at step s is satisfied at the end of the turn.
    assert (np.asarray(out.r) <= np.asarray(out.r_tilde)).all()


def test_dependency_gating_and_monotone_satisfaction():
    """Item 1 needs item 0. Item 1 satisfied first earns nothing, ever (SPEC §5.3)."""
    sat_after = np.array([[0, 1], [1, 0], [0, 1]], bool)  # [S=3, C=2]; item 1 flickers
    deps = np.array([[0, 0], [1, 0]], bool)
    step_mask = np.ones(3, bool)
    item_mask = np.ones(2, bool)
    r, r_tilde, eligible = checklist_step_rewards(sat_after, deps, step_mask, item_mask)
    # Step 0: E = {0}; item 1 is satisfied but not eligible. Step 1: item 0 earns.
    # Step 2: item 1 is already satisfied (monotone), so not eligible: never earns.
    np.testing.assert_array_equal(np.asarray(eligible), [[1, 0], [1, 0], [0, 0]])
    np.testing.assert_array_equal(np.asarray(r), [[0, 0], [1, 0], [0, 0]])
    np.testing.assert_array_equal(np.asarray(r_tilde), [[1, 0], [1, 0], [0, 0]])


def test_padding_items_steps_turns_members_leaves_results_unchanged():
    inputs = random_checklist(7)
    base = checklist_credit(*inputs, scale="std")
    sat_after, deps, weights, step_mask, item_mask, turn_mask = inputs
    pad = [(0, 0), (0, 1), (0, 2), (0, 1), (0, 2)]  # extra member, turns, steps, items
    padded_inputs = (
        np.pad(sat_after, pad, constant_values=True),
        np.pad(deps, [*pad[:3], (0, 2), (0, 2)], constant_values=True),
        np.pad(weights, [*pad[:3], (0, 2)], constant_values=0.5),
        np.pad(step_mask, pad[:4], constant_values=False),
        np.pad(item_mask, [*pad[:3], (0, 2)], constant_values=False),
        np.pad(turn_mask, pad[:3], constant_values=False),
    )
    padded = checklist_credit(*padded_inputs, scale="std")
    for field in base._fields:
        got = np.asarray(getattr(padded, field), np.float64)
        want = np.asarray(getattr(base, field), np.float64)
        crop = got[tuple(slice(0, n) for n in want.shape)]
        np.testing.assert_allclose(crop, want, atol=1e-6, err_msg=field)
        assert np.abs(got).sum() == pytest.approx(np.abs(want).sum(), abs=1e-4), field


def test_reference_normalizer_requires_reference_turns():
    with pytest.raises(ValueError, match="reference_turns"):
        checklist_credit(*random_checklist(0), turn_normalizer="reference")
    with pytest.raises(ValueError, match="turn_normalizer"):
        checklist_credit(*random_checklist(0), turn_normalizer="reached_turns")


def test_jit_equals_eager():
    inputs = random_checklist(3)
    jitted = jax.jit(checklist_credit, static_argnames=("scale", "ddof", "eps", "turn_normalizer"))
    a = jitted(*inputs, scale="std")
    b = checklist_credit(*inputs, scale="std")
    for field in a._fields:
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), atol=1e-6)
