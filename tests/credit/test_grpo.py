"""GRPO (SPEC §2) and MT-GRPO (SPEC §3): references, properties, padding."""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentrl.credit import grpo_advantages, mt_grpo_advantages

SETTINGS = settings(max_examples=40, deadline=None)
rewards_strategy = hnp.arrays(
    np.float64, (3, 5), elements=st.floats(-2, 2, allow_nan=False, width=32)
)


def reference_group_normalize(values, scale, ddof, eps):
    """Textbook z-score of a 1-D set (SPEC §1)."""
    values = np.asarray(values, np.float64)
    if len(values) <= ddof:
        return np.zeros_like(values)
    denominator = np.std(values, ddof=ddof) + eps if scale == "std" else 1.0
    return (values - values.mean()) / denominator


@SETTINGS
@given(rewards_strategy, st.sampled_from(["std", "none"]), st.sampled_from([0, 1]))
def test_grpo_matches_reference_and_group_means_are_zero(rewards, scale, ddof):
    advantages = np.asarray(grpo_advantages(rewards, scale=scale, ddof=ddof))
    for row, adv in zip(rewards, advantages, strict=True):
        np.testing.assert_allclose(adv, reference_group_normalize(row, scale, ddof, 1e-6),
                                   atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(advantages.mean(axis=1), 0.0, atol=1e-5)


def test_grpo_constant_group_gives_zero_and_ddof_rule():
    rewards = np.array([[0.3, 0.3, 0.3], [1.0, 0.0, 0.5]])
    advantages = np.asarray(grpo_advantages(rewards))
    np.testing.assert_array_equal(advantages[0], 0.0)
    # std([1, 0, .5], ddof=1) = 0.5: advantages = [0.5, -0.5, 0] / 0.500001.
    np.testing.assert_allclose(advantages[1], np.array([0.5, -0.5, 0.0]) / 0.500001, atol=1e-6)
    # One valid member with ddof=1: no spread, advantage 0 (SPEC §1).
    single = grpo_advantages(rewards, mask=np.array([[1, 0, 0], [1, 1, 1]], bool))
    np.testing.assert_array_equal(np.asarray(single)[0], 0.0)


@SETTINGS
@given(rewards_strategy, st.integers(1, 3), st.sampled_from(["std", "none"]))
def test_grpo_padding_members_leaves_results_unchanged(rewards, extra, scale):
    base = np.asarray(grpo_advantages(rewards, scale=scale))
    padded_rewards = np.concatenate([rewards, np.full((3, extra), 123.0)], axis=1)
    mask = np.concatenate([np.ones((3, 5), bool), np.zeros((3, extra), bool)], axis=1)
    padded = np.asarray(grpo_advantages(padded_rewards, scale=scale, mask=mask))
    np.testing.assert_allclose(padded[:, :5], base, atol=1e-6)
    np.testing.assert_array_equal(padded[:, 5:], 0.0)


def test_grpo_jit_equals_eager():
    rewards = np.random.default_rng(0).normal(size=(4, 8))
    jitted = jax.jit(grpo_advantages, static_argnames=("scale", "ddof", "eps"))(rewards)
    np.testing.assert_allclose(jitted, grpo_advantages(rewards), atol=1e-6)


def reference_mt_grpo(turn_rewards, turn_mask, outcome, scale="std", ddof=1, eps=1e-6):
    """Loop form of SPEC §3."""
    n, g, k = turn_rewards.shape
    out = np.zeros((n, g, k))
    for q in range(n):
        num_turns = turn_mask[q].sum(-1)
        valid = num_turns > 0
        outcome_adv = np.zeros(g)
        outcome_adv[valid] = reference_group_normalize(outcome[q][valid], scale, ddof, eps)
        intermediate_adv = np.zeros((g, k))
        for turn in range(k):
            members = [i for i in range(g) if turn < num_turns[i] - 1]
            normalised = reference_group_normalize(turn_rewards[q, members, turn], scale, ddof, eps)
            intermediate_adv[members, turn] = normalised
        for i in range(g):
            for turn in range(num_turns[i]):
                out[q, i, turn] = outcome_adv[i] + intermediate_adv[i, turn:num_turns[i] - 1].sum()
    return out


@SETTINGS
@given(
    hnp.arrays(np.float64, (2, 5, 4), elements=st.floats(-1, 1, width=32)),
    hnp.arrays(np.int64, (2, 5), elements=st.integers(0, 4)),
    hnp.arrays(np.float64, (2, 5), elements=st.floats(-1, 1, width=32)),
    st.sampled_from(["std", "none"]),
)
def test_mt_grpo_matches_loop_reference(turn_rewards, num_turns, outcome, scale):
    turn_mask = np.arange(4)[None, None, :] < num_turns[..., None]
    expected = reference_mt_grpo(turn_rewards, turn_mask, outcome, scale=scale)
    actual = mt_grpo_advantages(turn_rewards, turn_mask, outcome, scale=scale)
    np.testing.assert_allclose(actual, expected, atol=2e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(actual)[~turn_mask], 0.0)


def test_mt_grpo_two_turn_case_matches_paper():
    """Seed §3.3 eq. 6: Ā_1 = A_1 + A_2 (turn + outcome), Ā_2 = A_2 (outcome)."""
    rng = np.random.default_rng(1)
    turn_rewards = rng.normal(size=(2, 6, 2))
    outcome = rng.normal(size=(2, 6))
    turn_mask = np.ones((2, 6, 2), bool)
    actual = np.asarray(mt_grpo_advantages(turn_rewards, turn_mask, outcome))
    turn_adv = np.asarray(grpo_advantages(turn_rewards[..., 0]))
    outcome_adv = np.asarray(grpo_advantages(outcome))
    np.testing.assert_allclose(actual[..., 0], turn_adv + outcome_adv, atol=1e-5)
    np.testing.assert_allclose(actual[..., 1], outcome_adv, atol=1e-5)


def test_mt_grpo_padding_turns_and_members_leaves_results_unchanged():
    rng = np.random.default_rng(2)
    turn_rewards = rng.normal(size=(2, 4, 3))
    outcome = rng.normal(size=(2, 4))
    turn_mask = np.arange(3)[None, None, :] < rng.integers(1, 4, size=(2, 4))[..., None]
    base = np.asarray(mt_grpo_advantages(turn_rewards, turn_mask, outcome))
    # Two extra turns and one extra member, all padding with garbage values.
    padded_rewards = np.full((2, 5, 5), 77.0)
    padded_rewards[:, :4, :3] = turn_rewards
    padded_mask = np.zeros((2, 5, 5), bool)
    padded_mask[:, :4, :3] = turn_mask
    padded_outcome = np.concatenate([outcome, np.full((2, 1), -9.0)], axis=1)
    padded = np.asarray(mt_grpo_advantages(padded_rewards, padded_mask, padded_outcome))
    np.testing.assert_allclose(padded[:, :4, :3], base, atol=1e-6)
    np.testing.assert_array_equal(padded[:, 4], 0.0)
    np.testing.assert_array_equal(padded[:, :, 3:], 0.0)


def test_equal_rewards_give_exactly_zero_in_float32():
    """Rounding of the mean must not become (noise / eps) advantages."""
    rewards = np.full((1, 5), 1.64219618, np.float32)
    np.testing.assert_array_equal(np.asarray(grpo_advantages(rewards)), 0.0)
    turn_rewards = np.full((1, 5, 3), 0.45332855, np.float32)
    outcome = np.full((1, 5), 0.3, np.float32)
    out = mt_grpo_advantages(turn_rewards, np.ones((1, 5, 3), bool), outcome)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
