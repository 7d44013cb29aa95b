"""VSPO value-based resampling of zero-variance groups (SPEC §8).

Identity when no group or every group has variance; only live groups refill
dead slots; draw frequencies match `softmax(V / T)`; value smoothing gives a
group total weight `ω = α − (α − 1)/N_x`; jit = no-jit.
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentrl.credit import (
    vspo_probabilities,
    vspo_resample,
    vspo_slot_weights,
    vspo_value_scores,
)

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)
N, G = 6, 4
SEEDS = st.integers(0, 2**31 - 1)


def _close(actual, expected, atol=1e-6, rtol=1e-6):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol
    )


@jax.jit
def _resample(rewards, seed):
    return vspo_resample(rewards, jax.random.key(seed))


def _check_group_weights(slot_to_group, slot_weight, alpha):
    """Every group's slot weights sum to ω = α − (α − 1)/N_x."""
    for group in np.unique(slot_to_group):
        slots = slot_to_group == group
        copies = slots.sum()
        _close(slot_weight[slots].sum(), alpha - (alpha - 1.0) / copies, atol=1e-5)
        assert np.all(slot_weight[slots] == slot_weight[slots][0])


# ---------------------------------------------------------------- value scores


def test_value_scores_use_population_variance_and_batch_max():
    rewards = np.array([[0.0, 1.0], [0.2, 0.4], [0.3, 0.3]], np.float32)
    value, variance = vspo_value_scores(rewards)
    # Means 0.5, 0.3, 0.3; population variances 0.25, 0.01, 0 (not 0.5, 0.02).
    _close(variance, [0.25, 0.01, 0.0])
    # R_max = 1, the batch max (row 1's own max 0.4 would give 0.001).
    _close(value, [(1.0 - 0.5) * 0.25, (1.0 - 0.3) * 0.01, 0.0])
    jitted_value, jitted_variance = jax.jit(vspo_value_scores)(rewards)
    _close(jitted_value, value)
    _close(jitted_variance, variance)


def test_probabilities_all_zero_without_live_groups():
    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.4, 0.4, 0.4]], np.float32)
    probs, live = vspo_probabilities(rewards)
    assert not np.any(np.asarray(live))
    assert np.all(np.asarray(probs) == 0.0)


def test_probabilities_are_softmax_over_live_groups():
    rewards = np.array([[0.0, 1.0], [1.0, 1.0], [0.2, 0.4], [0.0, 0.5]], np.float32)
    probs, live = vspo_probabilities(rewards, temperature=0.5)
    np.testing.assert_array_equal(np.asarray(live), [True, False, True, True])
    value = np.array([0.5 * 0.25, 0.0, 0.7 * 0.01, 0.75 * 0.0625])
    logits = np.where([True, False, True, True], value / 0.5, -np.inf)
    _close(probs, np.exp(logits) / np.exp(logits).sum())


# ---------------------------------------------------------------- resampling


@st.composite
def constant_rows(draw):
    return np.repeat(draw(hnp.arrays(np.float32, (N, 1), elements=st.sampled_from(
        [0.0, 0.25, 1.0]))), G, axis=1)


@st.composite
def live_rows(draw):
    rewards = draw(hnp.arrays(np.float32, (N, G), elements=st.floats(0.0, 1.0, width=32)))
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0
    return rewards


@PROPERTY_SETTINGS
@given(rewards=st.one_of(constant_rows(), live_rows()), seed=SEEDS)
def test_identity_when_no_group_or_every_group_is_live(rewards, seed):
    slot_to_group, slot_weight = _resample(rewards, seed)
    np.testing.assert_array_equal(np.asarray(slot_to_group), np.arange(N))
    assert np.all(np.asarray(slot_weight) == 1.0)


@PROPERTY_SETTINGS
@given(
    rewards=hnp.arrays(np.float32, (N, G), elements=st.sampled_from([0.0, 0.5, 1.0])),
    seed=SEEDS,
)
def test_only_live_groups_refill_dead_slots(rewards, seed):
    slot_to_group, slot_weight = (np.asarray(x) for x in _resample(rewards, seed))
    live = rewards.var(axis=1) > 1e-6
    # Live slots keep their own group.
    np.testing.assert_array_equal(slot_to_group[live], np.arange(N)[live])
    if live.any() and not live.all():
        # Every dead slot now holds a live group.
        assert np.all(live[slot_to_group])
    else:
        np.testing.assert_array_equal(slot_to_group, np.arange(N))
    _check_group_weights(slot_to_group, slot_weight, alpha=2.0)


FREQUENCY_REWARDS = np.array(
    [
        [1.0, 1.0, 1.0, 1.0],
        [0.0, 1.0, 0.0, 0.0],
        [0.5, 0.5, 0.5, 0.5],
        [0.0, 0.0, 1.0, 1.0],
        [0.2, 0.9, 0.4, 0.4],
        [0.0, 0.0, 0.0, 0.0],
    ],
    np.float32,
)


def test_draw_frequencies_match_probabilities():
    num_draws, alpha = 20_000, 3.0
    keys = jax.random.split(jax.random.key(1234), num_draws)
    resample = jax.jit(jax.vmap(lambda key: vspo_resample(FREQUENCY_REWARDS, key, alpha=alpha)))
    slot_to_group, slot_weight = (np.asarray(x) for x in resample(keys))
    probs, live = (np.asarray(x) for x in vspo_probabilities(FREQUENCY_REWARDS))
    assert probs[live].min() > 0.1 and probs.max() < 0.6  # a non-degenerate target
    own_groups = np.broadcast_to(np.arange(N)[live], (num_draws, live.sum()))
    np.testing.assert_array_equal(slot_to_group[:, live], own_groups)
    drawn = slot_to_group[:, ~live].ravel()
    frequencies = np.bincount(drawn, minlength=N) / drawn.size
    _close(frequencies, probs, atol=0.01, rtol=0)
    assert np.all(frequencies[~live] == 0.0)
    # ω per group on every one of the draws: total weight of group x = α − (α − 1)/N_x.
    copies = (slot_to_group[:, :, None] == np.arange(N)).sum(axis=1)  # [draws, N]
    totals = np.zeros((num_draws, N))
    np.add.at(totals, (np.arange(num_draws)[:, None], slot_to_group), slot_weight)
    present = copies > 0
    omega = alpha - (alpha - 1.0) / np.maximum(copies, 1)
    _close(totals[present], omega[present], atol=1e-5)
    assert np.all(totals[~present] == 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resample_jit_equals_eager(seed):
    key = jax.random.key(seed)
    eager = vspo_resample(FREQUENCY_REWARDS, key, temperature=0.2, alpha=2.5)
    jitted = jax.jit(lambda k: vspo_resample(FREQUENCY_REWARDS, k, temperature=0.2, alpha=2.5))(
        key
    )
    np.testing.assert_array_equal(np.asarray(eager[0]), np.asarray(jitted[0]))
    _close(eager[1], jitted[1])


# ---------------------------------------------------------------- slot weights


@PROPERTY_SETTINGS
@given(
    slot_to_group=hnp.arrays(np.int32, (N,), elements=st.integers(0, N - 1)),
    alpha=st.floats(1.0, 4.0),
)
def test_slot_weights_sum_to_omega(slot_to_group, alpha):
    weights = np.asarray(jax.jit(vspo_slot_weights)(slot_to_group, alpha=alpha))
    _check_group_weights(slot_to_group, weights, alpha)


def test_slot_weights_hand_case():
    # Group 2 fills 4 slots: ω = 2 − 1/4 = 1.75, each copy 0.4375; group 5 fills 2:
    # ω = 1.5, each 0.75; group 0 fills one slot: 1.
    weights = vspo_slot_weights(np.array([2, 2, 5, 2, 2, 5, 0]), alpha=2.0)
    _close(weights, [0.4375, 0.4375, 0.75, 0.4375, 0.4375, 0.75, 1.0])
