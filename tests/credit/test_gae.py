"""Token-level GAE with observation masking and MT-PPO reward placement (SPEC §4).

Against textbook numpy loops: GAE on all-ones masks, GAE on the compacted
policy-only sequence scattered back for random masks, the backward linear
recurrence, and hand-computed MT-PPO placements.
"""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentrl.credit import (
    gae_advantages,
    mt_ppo_token_rewards,
    next_policy_values,
    reverse_linear_recurrence,
    whiten_advantages,
)

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)
UNIT = st.floats(0.0, 1.0)


def _close(actual, expected, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol
    )


def numpy_gae(rewards, values, gamma, lambda_):
    """Textbook GAE on one sequence; the value after the last step is 0."""
    rewards = np.asarray(rewards, np.float64)
    values = np.asarray(values, np.float64)
    advantages = np.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambda_ * running
        advantages[t] = running
    return advantages


def numpy_masked_gae(rewards, values, mask, gamma, lambda_):
    """GAE over the policy positions of each row, scattered back (0 elsewhere)."""
    advantages = np.zeros(np.shape(rewards), np.float64)
    for b in range(advantages.shape[0]):
        (policy,) = np.nonzero(mask[b])
        advantages[b, policy] = numpy_gae(rewards[b][policy], values[b][policy], gamma, lambda_)
    return advantages


def float_arrays(shape, low=-1.0, high=1.0):
    return hnp.arrays(np.float32, shape, elements=st.floats(low, high, width=32))


@st.composite
def rewards_values(draw, max_batch=3, max_length=12):
    batch = draw(st.integers(1, max_batch))
    length = draw(st.integers(1, max_length))
    return draw(float_arrays((batch, length))), draw(float_arrays((batch, length)))


# ---------------------------------------------------------------- GAE


@PROPERTY_SETTINGS
@given(data=rewards_values(), gamma=UNIT, lambda_=UNIT)
def test_all_ones_mask_is_textbook_gae(data, gamma, lambda_):
    rewards, values = data
    mask = np.ones(rewards.shape, bool)
    advantages, returns = _traced_gae(rewards, values, mask, gamma, lambda_)
    rows = zip(rewards, values, strict=True)
    expected = np.stack([numpy_gae(r, v, gamma, lambda_) for r, v in rows])
    _close(advantages, expected)
    _close(returns, expected + values)


MASKED_B, MASKED_T = 3, 12


@functools.cache
def _jitted_gae():
    return jax.jit(gae_advantages, static_argnames=("gamma", "lambda_"))


@jax.jit
def _traced_gae(rewards, values, mask, gamma, lambda_):
    # γ and λ traced: one compile per shape for the property tests.
    return gae_advantages(rewards, values, mask, gamma=gamma, lambda_=lambda_)


@PROPERTY_SETTINGS
@given(
    rewards=float_arrays((MASKED_B, MASKED_T)),
    values=float_arrays((MASKED_B, MASKED_T)),
    mask=hnp.arrays(bool, (MASKED_B, MASKED_T)),
    gamma=UNIT,
    lambda_=UNIT,
)
def test_masked_gae_equals_compacted_gae(rewards, values, mask, gamma, lambda_):
    advantages, returns = _traced_gae(rewards, values, mask, gamma, lambda_)
    advantages, returns = np.asarray(advantages), np.asarray(returns)
    expected = numpy_masked_gae(rewards, values, mask, gamma, lambda_)
    _close(advantages, expected)
    _close(returns[mask], (expected + values)[mask])
    assert np.all(advantages[~mask] == 0.0)
    assert np.all(returns[~mask] == 0.0)


def test_masked_rewards_and_values_are_ignored():
    rng = np.random.default_rng(3)
    rewards, values = rng.normal(size=(2, 2, 9)).astype(np.float32)
    mask = np.array([[1, 1, 0, 0, 1, 0, 1, 1, 0], [0, 1, 0, 1, 1, 1, 0, 0, 1]], bool)
    garbage_rewards = np.where(mask, rewards, 1e3).astype(np.float32)
    garbage_values = np.where(mask, values, -1e3).astype(np.float32)
    clean = gae_advantages(rewards, values, mask, gamma=0.9, lambda_=0.7)
    dirty = gae_advantages(garbage_rewards, garbage_values, mask, gamma=0.9, lambda_=0.7)
    for a, b in zip(clean, dirty, strict=True):
        _close(a, b, atol=1e-6)


@pytest.mark.parametrize("gamma, lambda_", [(1.0, 1.0), (0.9, 0.8), (0.5, 0.0)])
def test_gae_jit_equals_eager(gamma, lambda_):
    rng = np.random.default_rng(4)
    rewards, values = rng.normal(size=(2, 3, 10)).astype(np.float32)
    mask = rng.random((3, 10)) < 0.6
    eager = gae_advantages(rewards, values, mask, gamma=gamma, lambda_=lambda_)
    jitted = _jitted_gae()(rewards, values, mask, gamma=gamma, lambda_=lambda_)
    for a, b in zip(eager, jitted, strict=True):
        _close(a, b, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True], ids=["all_ones", "random_mask"])
def test_gae_at_scale_matches_numpy_loop(masked):
    rng = np.random.default_rng(5)
    batch, length = 2, 4096
    rewards = rng.normal(scale=0.1, size=(batch, length)).astype(np.float32)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    mask = rng.random((batch, length)) < 0.7 if masked else np.ones((batch, length), bool)
    gamma, lambda_ = 0.999, 0.97
    advantages, returns = _jitted_gae()(rewards, values, mask, gamma=gamma, lambda_=lambda_)
    expected = numpy_masked_gae(rewards, values, mask, gamma, lambda_)
    _close(advantages, expected, atol=1e-3, rtol=1e-4)
    _close(np.asarray(returns)[mask], (expected + values)[mask], atol=1e-3, rtol=1e-4)


# ---------------------------------------------------------------- building blocks


@pytest.mark.parametrize("method", ["auto", "scan", "associative"])
def test_reverse_linear_recurrence_matches_numpy_loop(method):
    rng = np.random.default_rng(6)
    decay = rng.uniform(-1.2, 1.2, size=(2, 3, 17)).astype(np.float32)
    inputs = rng.normal(size=(2, 3, 17)).astype(np.float32)
    expected = np.zeros(inputs.shape, np.float64)
    running = np.zeros(inputs.shape[:-1])
    for t in reversed(range(inputs.shape[-1])):
        running = inputs[..., t] + decay[..., t] * running
        expected[..., t] = running
    _close(reverse_linear_recurrence(decay, inputs, method=method), expected, atol=1e-4)
    jitted = jax.jit(functools.partial(reverse_linear_recurrence, method=method))
    _close(jitted(decay, inputs), expected, atol=1e-4)


def test_reverse_linear_recurrence_hand_case():
    # x_3 = 4; x_2 = 3 + 0·4 = 3; x_1 = 2 + 2·3 = 8; x_0 = 1 + 0.5·8 = 5.
    decay = np.array([[0.5, 2.0, 0.0, 10.0]], np.float32)
    inputs = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    _close(reverse_linear_recurrence(decay, inputs), [[5.0, 8.0, 3.0, 4.0]])


def test_next_policy_values_hand_case():
    values = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 10.0, 11.0, 12.0]])
    mask = np.array([[1, 0, 0, 1, 0, 1], [0, 0, 1, 0, 0, 0]], bool)
    expected = [[4.0, 4.0, 4.0, 6.0, 6.0, 0.0], [9.0, 9.0, 0.0, 0.0, 0.0, 0.0]]
    _close(next_policy_values(values.astype(np.float32), mask), expected, atol=0)


# ---------------------------------------------------------------- whitening


@PROPERTY_SETTINGS
@given(
    advantages=float_arrays((3, 10), -5.0, 5.0),
    mask=hnp.arrays(bool, (3, 10)),
)
def test_whiten_advantages_standardises_policy_tokens(advantages, mask):
    selected = advantages[mask].astype(np.float64)
    spread = selected.std(ddof=1) if selected.size > 1 else 0.0
    whitened = np.asarray(whiten_advantages(advantages, mask))
    assert np.all(whitened[~mask] == 0.0)
    assert np.all(np.isfinite(whitened))
    if spread > 1e-2:
        _close(whitened[mask].mean(), 0.0, atol=1e-5)
        _close(whitened[mask].var(ddof=1), 1.0, atol=1e-4, rtol=1e-4)
        _close(whitened[mask], (selected - selected.mean()) / spread, atol=1e-4, rtol=1e-4)


def test_whiten_without_mean_shift_keeps_the_mean():
    advantages = np.array([[1.0, 3.0, 100.0, -4.0], [5.0, -7.0, 0.0, 8.0]], np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], bool)
    # Policy values 1, 3, 5: mean 3, unbiased variance 4 (std 2).
    expected = np.where(mask, (advantages - 3.0) / 2.0 + 3.0, 0.0)
    _close(whiten_advantages(advantages, mask, shift_mean=False), expected)
    _close(whiten_advantages(advantages, mask), np.where(mask, (advantages - 3.0) / 2.0, 0.0))
    jitted = jax.jit(functools.partial(whiten_advantages, shift_mean=False))
    _close(jitted(advantages, mask), expected)


# ---------------------------------------------------------------- MT-PPO placement

# Row 0: three valid turns; environment tokens between turns and at the end.
# Row 1: two valid turns (third padded); an environment insert inside turn 0.
TURN_ID = np.array(
    [
        [0, 0, -1, -1, 1, -1, 2, 2, -1],
        [0, -1, 0, 0, -1, 1, -1, -1, -1],
    ],
    np.int32,
)
LOSS_MASK = TURN_ID >= 0
TURN_MASK = np.array([[1, 1, 1], [1, 1, 0]], bool)
TURN_REWARDS = np.array([[0.1, 0.2, 0.7], [0.5, 9.0, 7.0]], np.float32)
FINAL_REWARD = np.array([1.0, -0.5], np.float32)
EXPECTED_PLACEMENT = np.array(
    [
        # R^I_0 at position 1 (end of turn 0), R^I_1 at 4, R^F at 7; R^I_2 = 0.7 ignored.
        [0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0, 1.0, 0.0],
        # R^I_0 at 3 (last policy token of turn 0), R^F at 5; 9.0 (final) and 7.0 ignored.
        [0.0, 0.0, 0.0, 0.5, 0.0, -0.5, 0.0, 0.0, 0.0],
    ]
)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mt_ppo_placement_hand_case(jit):
    fn = jax.jit(mt_ppo_token_rewards) if jit else mt_ppo_token_rewards
    placed = np.asarray(fn(FINAL_REWARD, TURN_REWARDS, TURN_MASK, TURN_ID, LOSS_MASK))
    _close(placed, EXPECTED_PLACEMENT, atol=1e-7)
    _close(placed.sum(axis=1), [1.0 + 0.1 + 0.2, -0.5 + 0.5], atol=1e-6)


def test_mt_ppo_single_turn_gets_only_final_reward():
    turn_id = np.array([[-1, 0, 0, 0, -1]], np.int32)
    placed = mt_ppo_token_rewards(
        np.array([2.0]), np.array([[5.0, 6.0]]), np.array([[1, 0]], bool), turn_id, turn_id >= 0
    )
    _close(placed, [[0.0, 0.0, 0.0, 2.0, 0.0]], atol=0)


MT_B, MT_K, MT_MAX_POLICY, MT_MAX_ENV = 3, 4, 3, 2
MT_T = MT_K * (MT_MAX_POLICY + MT_MAX_ENV) + 1


@st.composite
def turn_layouts(draw):
    """Rows of (env tokens, policy tokens) per turn, padded with env tokens to MT_T."""
    turn_id = np.full((MT_B, MT_T), -1, np.int32)
    turn_mask = np.zeros((MT_B, MT_K), bool)
    for b in range(MT_B):
        num_turns = draw(st.integers(1, MT_K))
        turn_mask[b, :num_turns] = True
        position = 0
        for k in range(num_turns):
            position += draw(st.integers(0, MT_MAX_ENV))
            length = draw(st.integers(1, MT_MAX_POLICY))
            turn_id[b, position:position + length] = k
            position += length
    return turn_id, turn_mask


@functools.cache
def _jitted_mt_ppo():
    return jax.jit(mt_ppo_token_rewards)


@PROPERTY_SETTINGS
@given(
    layout=turn_layouts(),
    turn_rewards=float_arrays((MT_B, MT_K)),
    final_reward=float_arrays((MT_B,)),
)
def test_mt_ppo_placement_property(layout, turn_rewards, final_reward):
    turn_id, turn_mask = layout
    loss_mask = turn_id >= 0
    placed = np.asarray(
        _jitted_mt_ppo()(final_reward, turn_rewards, turn_mask, turn_id, loss_mask)
    )
    expected = np.zeros((MT_B, MT_T))
    for b in range(MT_B):
        num_turns = turn_mask[b].sum()
        for k in range(num_turns - 1):
            expected[b, np.nonzero(turn_id[b] == k)[0].max()] += turn_rewards[b, k]
        expected[b, np.nonzero(loss_mask[b])[0].max()] += final_reward[b]
        total = final_reward[b] + turn_rewards[b, : num_turns - 1].sum()
        _close(placed[b].sum(), total, atol=1e-5)
    _close(placed, expected, atol=1e-6)
    assert np.all(placed[~loss_mask] == 0.0)


def test_mt_ppo_feeds_gae_with_gamma_lambda_one():
    # With γ = λ = 1 and zero values, every policy token's advantage is the
    # reward still to come in its trajectory (turn by turn).
    placed = mt_ppo_token_rewards(FINAL_REWARD, TURN_REWARDS, TURN_MASK, TURN_ID, LOSS_MASK)
    values = np.zeros(TURN_ID.shape, np.float32)
    advantages, _ = gae_advantages(placed, values, LOSS_MASK, gamma=1.0, lambda_=1.0)
    expected = [
        [1.3, 1.3, 0.0, 0.0, 1.2, 0.0, 1.0, 1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0],  # turn 0: 0.5 − 0.5
    ]
    _close(advantages, expected, atol=1e-6)


def test_scan_and_associative_recurrences_agree_at_scale():
    """The GPU path (associative) and the CPU path (scan) of GAE give the same numbers."""
    rng = np.random.default_rng(11)
    decay = np.where(rng.random((4, 4096)) < 0.7, 0.999 * 0.97, 1.0).astype(np.float32)
    inputs = rng.normal(scale=0.1, size=(4, 4096)).astype(np.float32)
    scan = reverse_linear_recurrence(decay, inputs, method="scan")
    associative = reverse_linear_recurrence(decay, inputs, method="associative")
    _close(associative, scan, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="method='parallel'"):
        reverse_linear_recurrence(decay, inputs, method="parallel")
