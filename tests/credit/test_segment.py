"""CARL segment advantages and Monte-Carlo critic loss (SPEC §9.2, §9.3).

Properties: telescoping at λ = 0, `A_k = R − V_k` at λ = γ = 1, a numpy
reference for general γ, λ, padding invariance, zeros on padding, jit = no-jit.
"""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentrl.credit import segment_advantages, segment_critic_loss

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)
B, S = 4, 7


def _close(actual, expected, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol
    )


def numpy_segment_advantages(values, seg_mask, reward, gamma, lambda_):
    """δ_k = γ V_{k+1} − V_k (δ_N = R − V_N), A_k = Σ_l (γλ)^l δ_{k+l}, on the valid prefix."""
    values = np.asarray(values, np.float64)
    advantages = np.zeros_like(values)
    for b in range(values.shape[0]):
        n = int(np.sum(seg_mask[b]))
        if n == 0:
            continue
        v = values[b, :n]
        delta = np.append(gamma * v[1:] - v[:-1], reward[b] - v[-1])
        for k in range(n):
            lags = np.arange(n - k)
            advantages[b, k] = np.sum((gamma * lambda_) ** lags * delta[k:])
    return advantages


_critic = jax.jit(segment_critic_loss)


def numpy_critic_loss(values, seg_mask, reward):
    per_row = [
        np.mean((np.asarray(values[b], np.float64)[seg_mask[b]] - reward[b]) ** 2)
        for b in range(values.shape[0])
        if seg_mask[b].any()
    ]
    return float(np.mean(per_row)) if per_row else 0.0


def prefix_mask(lengths, num_segments):
    return np.arange(num_segments)[None, :] < np.asarray(lengths)[:, None]


VALUES = hnp.arrays(np.float32, (B, S), elements=st.floats(-1.0, 1.0, width=32))
REWARD = hnp.arrays(np.float32, (B,), elements=st.floats(0.0, 1.0, width=32))
LENGTHS = hnp.arrays(np.int32, (B,), elements=st.integers(0, S))


@jax.jit
def _traced(values, seg_mask, reward, gamma, lambda_):
    # γ and λ traced: one compile for all property examples.
    return segment_advantages(values, seg_mask, reward, gamma=gamma, lambda_=lambda_)


@PROPERTY_SETTINGS
@given(values=VALUES, reward=REWARD, lengths=LENGTHS)
def test_lambda_zero_telescopes(values, reward, lengths):
    seg_mask = prefix_mask(lengths, S)
    advantages = np.asarray(_traced(values, seg_mask, reward, 1.0, 0.0))
    non_empty = lengths > 0
    _close(advantages.sum(axis=1)[non_empty], (reward - values[:, 0])[non_empty])
    assert np.all(advantages[~seg_mask] == 0.0)


@PROPERTY_SETTINGS
@given(values=VALUES, reward=REWARD, lengths=LENGTHS)
def test_lambda_one_gives_reward_minus_value(values, reward, lengths):
    seg_mask = prefix_mask(lengths, S)
    advantages = np.asarray(_traced(values, seg_mask, reward, 1.0, 1.0))
    expected = np.where(seg_mask, reward[:, None] - values, 0.0)
    _close(advantages, expected)


@PROPERTY_SETTINGS
@given(
    values=VALUES,
    reward=REWARD,
    lengths=LENGTHS,
    gamma=st.floats(0.0, 1.0),
    lambda_=st.floats(0.0, 1.0),
)
def test_general_gamma_lambda_matches_numpy(values, reward, lengths, gamma, lambda_):
    seg_mask = prefix_mask(lengths, S)
    advantages = np.asarray(_traced(values, seg_mask, reward, gamma, lambda_))
    _close(advantages, numpy_segment_advantages(values, seg_mask, reward, gamma, lambda_))
    assert np.all(advantages[~seg_mask] == 0.0)


def test_hand_case_gamma_lambda_half():
    # V = (0.2, 0.6, 0.5), R = 1, γ = 0.5, λ = 0.5 (γλ = 0.25):
    # δ = (0.5·0.6 − 0.2, 0.5·0.5 − 0.6, 1 − 0.5) = (0.1, −0.35, 0.5)
    # A_2 = 0.5; A_1 = −0.35 + 0.25·0.5 = −0.225; A_0 = 0.1 + 0.25·(−0.225) = 0.04375.
    values = np.array([[0.2, 0.6, 0.5, 7.0]], np.float32)
    seg_mask = np.array([[1, 1, 1, 0]], bool)
    out = segment_advantages(values, seg_mask, np.array([1.0]), gamma=0.5, lambda_=0.5)
    _close(out, [[0.04375, -0.225, 0.5, 0.0]], atol=1e-6)


@PROPERTY_SETTINGS
@given(
    values=VALUES,
    reward=REWARD,
    lengths=LENGTHS,
    garbage=hnp.arrays(np.float32, (B, 3), elements=st.floats(-1e3, 1e3, width=32)),
    gamma=st.floats(0.0, 1.0),
    lambda_=st.floats(0.0, 1.0),
)
def test_padding_segments_change_nothing(values, reward, lengths, garbage, gamma, lambda_):
    seg_mask = prefix_mask(lengths, S)
    padded_values = np.concatenate([values, garbage], axis=1)
    padded_mask = np.concatenate([seg_mask, np.zeros((B, 3), bool)], axis=1)
    base = np.asarray(_traced(values, seg_mask, reward, gamma, lambda_))
    padded = np.asarray(_traced(padded_values, padded_mask, reward, gamma, lambda_))
    _close(padded[:, :S], base, atol=1e-6)
    assert np.all(padded[:, S:] == 0.0)
    _close(
        _critic(padded_values, padded_mask, reward), _critic(values, seg_mask, reward), atol=1e-6
    )


def test_garbage_values_on_padding_are_ignored():
    values = np.array([[0.1, 0.4, 0.9, 0.3], [0.5, 0.2, 0.7, 0.6]], np.float32)
    seg_mask = np.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool)
    reward = np.array([1.0, 0.0], np.float32)
    dirty = np.where(seg_mask, values, 1e6).astype(np.float32)
    for lambda_ in (0.0, 0.5, 1.0):
        _close(
            segment_advantages(dirty, seg_mask, reward, gamma=0.9, lambda_=lambda_),
            segment_advantages(values, seg_mask, reward, gamma=0.9, lambda_=lambda_),
            atol=1e-6,
        )
    _close(_critic(dirty, seg_mask, reward), _critic(values, seg_mask, reward))


# ---------------------------------------------------------------- critic loss


@PROPERTY_SETTINGS
@given(values=VALUES, reward=REWARD, lengths=LENGTHS)
def test_critic_loss_matches_numpy(values, reward, lengths):
    seg_mask = prefix_mask(lengths, S)
    loss = _critic(values, seg_mask, reward)
    _close(loss, numpy_critic_loss(values, seg_mask, reward))


def test_critic_loss_hand_case_skips_empty_rows():
    values = np.array([[0.5, 1.0, 0.0], [9.0, 9.0, 9.0], [0.25, 0.0, 0.0]], np.float32)
    seg_mask = np.array([[1, 1, 1], [0, 0, 0], [1, 0, 0]], bool)
    reward = np.array([1.0, 0.0, 0.0], np.float32)
    # Row 0: (0.25 + 0 + 1) / 3; row 1 empty (skipped); row 2: 0.0625.
    expected = ((1.25 / 3.0) + 0.0625) / 2.0
    _close(segment_critic_loss(values, seg_mask, reward), expected, atol=1e-7)


def test_critic_loss_empty_batch_is_zero():
    values = np.array([[3.0, -2.0], [1e6, 0.5]], np.float32)
    seg_mask = np.zeros((2, 2), bool)
    reward = np.array([1.0, 0.0], np.float32)
    assert float(segment_critic_loss(values, seg_mask, reward)) == 0.0
    assert float(jax.jit(segment_critic_loss)(values, seg_mask, reward)) == 0.0
    grad = jax.grad(segment_critic_loss)(values, seg_mask, reward)
    assert np.all(np.asarray(grad) == 0.0)


# ---------------------------------------------------------------- jit


@pytest.mark.parametrize("gamma, lambda_", [(1.0, 0.0), (0.9, 0.5), (1.0, 1.0)])
def test_jit_equals_eager(gamma, lambda_):
    rng = np.random.default_rng(7)
    values = rng.uniform(size=(3, 6)).astype(np.float32)
    seg_mask = prefix_mask([6, 2, 0], 6)
    reward = np.array([1.0, 0.0, 1.0], np.float32)
    jitted = jax.jit(functools.partial(segment_advantages, gamma=gamma, lambda_=lambda_))
    eager = segment_advantages(values, seg_mask, reward, gamma=gamma, lambda_=lambda_)
    _close(jitted(values, seg_mask, reward), eager, atol=1e-6)
    _close(jax.jit(segment_critic_loss)(values, seg_mask, reward),
           segment_critic_loss(values, seg_mask, reward), atol=1e-7)
