"""Per-token losses and their reductions (SPEC §10, §9.3).

Hand-computed cases (different from `spec_examples.json`, which
`test_spec_examples.py` checks) plus property tests: finite gradients under
arbitrary masks and exactly-zero gradients at masked positions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentrl import losses

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)
B, T = 3, 6


def _close(actual, expected, atol=1e-6, rtol=1e-6):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol
    )


def _ppo(ratios, advantages, **options):
    """ppo_clip_loss with logp = log(ratio) and old_logp = 0."""
    logp = np.log(np.asarray(ratios, np.float64)).astype(np.float32)[None, :]
    advantages = np.asarray(advantages, np.float32)[None, :]
    return np.asarray(losses.ppo_clip_loss(logp, np.zeros_like(logp), advantages, **options))[0]


# ---------------------------------------------------------------- ppo_clip_loss


def test_ppo_clip_symmetric_hand_cases():
    # (ratio, A) -> max(-A r, -A clip(r, 0.8, 1.2))
    ratios = [1.5, 0.5, 0.5, 1.5, 1.1, 1.0]
    advantages = [1.0, 1.0, -1.0, -1.0, 2.0, -3.0]
    expected = [
        -1.2,  # A > 0, r above 1 + ε: clipped (no extra credit)
        -0.5,  # A > 0, r below 1 − ε: unclipped (pessimistic)
        0.8,  # A < 0, r below 1 − ε: clipped
        1.5,  # A < 0, r above 1 + ε: unclipped
        -2.2,  # inside the trust region
        3.0,  # r = 1
    ]
    _close(_ppo(ratios, advantages), expected)


def test_ppo_clip_asymmetric_hand_cases():
    ratios = [1.5, 1.25, 0.5, 0.85, 0.5]
    advantages = [1.0, 1.0, -1.0, -1.0, 2.0]
    # clip(r, 0.9, 1.3)
    expected = [-1.3, -1.25, 0.9, 0.9, -1.0]
    _close(_ppo(ratios, advantages, clip_low=0.1, clip_high=0.3), expected)
    # Symmetric 0.2 would have clipped the 1.25 at 1.2 and the 0.85 would stay.
    _close(_ppo(ratios, advantages), [-1.2, -1.2, 0.8, 0.85, -1.0])


def test_ppo_dual_clip_only_for_negative_advantages():
    ratios = [5.0, 2.0, 5.0, 0.1, 100.0, 5.0]
    advantages = [-1.0, -1.0, 1.0, 2.0, -0.5, 0.0]
    plain = _ppo(ratios, advantages)
    dual = _ppo(ratios, advantages, dual_clip=3.0)
    _close(plain, [5.0, 2.0, -1.2, -0.2, 50.0, 0.0], rtol=1e-5)
    # A < 0: min(ℓ, −A c); capped at 3 and 1.5, untouched at 2 (< 3).
    # A ≥ 0: identical to the plain loss.
    _close(dual, [3.0, 2.0, -1.2, -0.2, 1.5, 0.0], rtol=1e-5)
    non_negative = np.asarray(advantages) >= 0
    assert np.all(dual[non_negative] == plain[non_negative])


def test_ppo_dual_clip_caps_at_minus_a_times_c_for_huge_ratios():
    advantages = np.array([[-0.3, -2.0, -7.0]], np.float32)
    logp = np.full((1, 3), 50.0, np.float32)
    loss = losses.ppo_clip_loss(logp, np.zeros_like(logp), advantages, dual_clip=4.0)
    _close(loss, -advantages * 4.0, rtol=1e-6)


@pytest.mark.parametrize("dual_clip", [1.0, 0.5])
def test_ppo_dual_clip_must_exceed_one(dual_clip):
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.ppo_clip_loss(x, x, x, dual_clip=dual_clip)


def test_ppo_log_ratio_clamp_keeps_huge_differences_finite():
    logp = np.array([[1e4, 1e4, -1e4, -1e4, 0.0]], np.float32)
    old_logp = np.array([[0.0, 0.0, 0.0, 0.0, 1e4]], np.float32)
    advantages = np.array([[-1.0, 1.0, -1.0, 1.0, 1.0]], np.float32)
    loss = np.asarray(losses.ppo_clip_loss(logp, old_logp, advantages))
    assert np.all(np.isfinite(loss))
    big, small = np.exp(20.0), np.exp(-20.0)
    _close(loss, [[big, -1.2, 0.8, -small, -small]], rtol=1e-5, atol=0)

    def total(lp):
        return losses.ppo_clip_loss(lp, old_logp, advantages).sum()

    grad = np.asarray(jax.grad(total)(jnp.asarray(logp)))
    assert np.all(np.isfinite(grad))


# ---------------------------------------------------------------- aggregate_loss

PER_TOKEN = np.array(
    [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]], np.float32
)
MASK = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 1, 0]], bool)
# Row 0: segment 1 holds a masked token (position 2), which must not count.
SEGMENT_IDS = np.array([[0, 0, 1, 1], [-1, -1, -1, -1], [-1, 0, 1, -1]], np.int32)
# Policy tokens: row 0 = 1, 2, 4 (sum 7); row 1 empty; row 2 = 10, 11 (sum 21).
EXPECTED = {
    "token_mean": 28.0 / 5.0,
    "seq_mean_token_mean": (7.0 / 3.0 + 10.5) / 2.0,
    "seq_mean_token_sum": (7.0 + 21.0) / 2.0,
    "seq_mean_token_sum_norm": 28.0 / (3 * 5),  # norm_length = 5, empty row counted
    "segment_mean_sum": ((1.5 + 4.0) + (10.0 + 11.0)) / 2.0,
}


def _aggregate(per_token, mask, mode, segment_ids, norm_length=None):
    return losses.aggregate_loss(
        per_token, mask, mode, segment_ids=segment_ids, norm_length=norm_length
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_aggregate_hand_example(mode, jit):
    fn = functools.partial(_aggregate, mode=mode, norm_length=5)
    if jit:
        fn = jax.jit(fn)
    _close(fn(PER_TOKEN, MASK, segment_ids=SEGMENT_IDS), EXPECTED[mode], rtol=1e-6)


def test_seq_mean_token_sum_norm_defaults_to_t():
    value = losses.aggregate_loss(PER_TOKEN, MASK, "seq_mean_token_sum_norm")
    _close(value, 28.0 / (3 * 4), rtol=1e-6)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_empty_batch_gives_exactly_zero(mode):
    per_token = np.array([[3.0, -1e6, 7.0], [1e30, 2.0, -5.0]], np.float32)
    mask = np.zeros_like(per_token, bool)
    segment_ids = np.array([[0, 0, 1], [-1, -1, -1]], np.int32)
    value = losses.aggregate_loss(per_token, mask, mode, segment_ids=segment_ids)
    assert float(value) == 0.0
    jitted = jax.jit(functools.partial(_aggregate, mode=mode))(
        per_token, mask, segment_ids=segment_ids
    )
    assert float(jitted) == 0.0


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_empty_rows_skipped_except_in_sum_norm(mode):
    keep = [0, 2]
    with_empty = _aggregate(PER_TOKEN, MASK, mode, SEGMENT_IDS, norm_length=5)
    without = _aggregate(PER_TOKEN[keep], MASK[keep], mode, SEGMENT_IDS[keep], norm_length=5)
    if mode == "seq_mean_token_sum_norm":
        _close(with_empty, 28.0 / 15.0)
        _close(without, 28.0 / 10.0)
    else:
        _close(with_empty, without)


def test_segment_mean_sum_needs_segment_ids():
    with pytest.raises(ValueError, match="segment_ids"):
        losses.aggregate_loss(PER_TOKEN, MASK, "segment_mean_sum")


def test_unknown_mode_is_named():
    with pytest.raises(ValueError, match="seq_mean_bogus"):
        losses.aggregate_loss(PER_TOKEN, MASK, "seq_mean_bogus")


# ---------------------------------------------------------------- kl_divergence


@PROPERTY_SETTINGS
@given(
    d=hnp.arrays(
        np.float32,
        (4, 8),
        elements=st.one_of(
            st.floats(-2.0**-10, 2.0**-10, width=32), st.floats(-40.0, 40.0, width=32)
        ),
    )
)
def test_k3_is_nonnegative_and_bounded(d):
    k3 = np.asarray(losses.kl_divergence(d, np.zeros_like(d), "k3"))
    assert np.all(k3 >= 0.0)
    assert np.all(k3 <= losses.K3_CLAMP)
    small = np.abs(d) < 1.0
    reference = np.exp(-d.astype(np.float64)) - 1.0 + d
    _close(k3[small], reference[small], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_kl_is_zero_when_policies_agree(kind):
    logp = np.array([[-0.1, -3.0, -20.0], [-1e-4, -7.5, 0.0]], np.float32)
    kl = np.asarray(losses.kl_divergence(logp, logp.copy(), kind))
    assert np.all(kl == 0.0)


def test_k3_clamped_for_huge_differences():
    logp = np.array([[1e4, -1e4, 30.0, -30.0, 0.0]], np.float32)
    k3 = np.asarray(losses.kl_divergence(logp, np.zeros_like(logp), "k3"))
    assert np.all(np.isfinite(k3))
    _close(k3, [[10.0, 10.0, 10.0, 10.0, 0.0]])
    grad = jax.grad(lambda x: losses.kl_divergence(x, jnp.zeros_like(x), "k3").sum())(logp)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_kl_kinds_hand_values():
    logp = np.array([[0.5, -2.0]], np.float32)
    ref = np.zeros_like(logp)
    _close(losses.kl_divergence(logp, ref, "k1"), [[0.5, -2.0]])
    _close(losses.kl_divergence(logp, ref, "abs"), [[0.5, 2.0]])
    _close(losses.kl_divergence(logp, ref, "k2"), [[0.125, 2.0]])
    _close(
        losses.kl_divergence(logp, ref, "k3"),
        [[np.exp(-0.5) - 0.5, np.exp(2.0) - 3.0]],
        rtol=1e-6,
    )


def test_kl_unknown_kind_raises():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="k4"):
        losses.kl_divergence(x, x, "k4")


# ---------------------------------------------------------------- entropy


@pytest.mark.parametrize("vocab", [2, 7, 1000])
def test_entropy_of_uniform_logits_is_log_v(vocab):
    logits = np.full((2, 3, vocab), 1.7, np.float32)
    _close(losses.entropy_from_logits(logits), np.full((2, 3), np.log(vocab)), rtol=1e-5)


def test_entropy_of_one_hot_logits_is_near_zero():
    logits = np.zeros((2, 50), np.float32)
    logits[0, 3] = 60.0
    logits[1, 49] = 80.0
    entropy = np.asarray(losses.entropy_from_logits(logits))
    assert np.all(entropy >= 0.0)
    assert np.all(entropy < 1e-10)


def test_entropy_matches_numpy_reference():
    logits = np.random.default_rng(0).normal(scale=3.0, size=(2, 3, 11)).astype(np.float32)
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
    reference = -(probs * np.log(probs)).sum(axis=-1)
    _close(losses.entropy_from_logits(logits), reference, rtol=1e-5, atol=1e-6)
    _close(jax.jit(losses.entropy_from_logits)(logits), reference, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- value_loss


def test_value_loss_without_clip_is_squared_error():
    values = np.array([[0.5, -1.0, 2.0]], np.float32)
    returns = np.array([[1.0, 1.0, 2.0]], np.float32)
    _close(losses.value_loss(values, returns), [[0.25, 4.0, 0.0]])
    # old_values are ignored without clip_range.
    _close(losses.value_loss(values, returns, values + 10.0), [[0.25, 4.0, 0.0]])


def test_value_loss_clip_hand_cases():
    values = np.array([[0.5, 1.0, 0.0, 0.1]], np.float32)
    old_values = np.array([[0.0, 0.0, 1.0, 0.0]], np.float32)
    returns = np.array([[1.0, 0.0, 1.0, 0.0]], np.float32)
    # clipped = old + clip(V − old, ±0.2) = 0.2, 0.2, 0.8, 0.1
    expected = [[max(0.25, 0.64), max(1.0, 0.04), max(1.0, 0.04), 0.01]]
    _close(losses.value_loss(values, returns, old_values, clip_range=0.2), expected, rtol=1e-6)


def test_value_loss_clip_matches_numpy_reference():
    rng = np.random.default_rng(1)
    values, old_values, returns = rng.normal(size=(3, 2, 9)).astype(np.float32)
    clip_range = 0.3
    v, old, ret = (x.astype(np.float64) for x in (values, old_values, returns))
    clipped = old + np.clip(v - old, -clip_range, clip_range)
    reference = np.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    out = losses.value_loss(values, returns, old_values, clip_range=clip_range)
    _close(out, reference, rtol=1e-5, atol=1e-6)
    jitted = jax.jit(functools.partial(losses.value_loss, clip_range=clip_range))
    _close(jitted(values, returns, old_values), reference, rtol=1e-5, atol=1e-6)


def test_value_loss_clip_needs_old_values():
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="old_values"):
        losses.value_loss(x, x, clip_range=0.2)


# ---------------------------------------------------------------- importance weights


def test_truncated_importance_weights():
    old_logp = np.array([[0.0, 0.5, -0.5, 1.0, 1e4, -1e4, 0.69]], np.float32)
    rollout_logp = np.zeros_like(old_logp)
    weights = np.asarray(losses.truncated_importance_weights(old_logp, rollout_logp))
    assert np.all(np.isfinite(weights))
    assert np.all(weights <= 2.0)
    assert np.all(weights > 0.0)
    ratio = np.exp(np.clip(old_logp.astype(np.float64), -20.0, 20.0))
    below = ratio < 2.0
    assert below.sum() == 5
    _close(weights[below], ratio[below], rtol=1e-6)
    _close(weights[~below], 2.0)
    capped = losses.truncated_importance_weights(old_logp, rollout_logp, cap=1.5)
    _close(capped, np.minimum(ratio, 1.5), rtol=1e-6)


# ---------------------------------------------------------------- gradients under masks


@st.composite
def masked_batches(draw):
    """(mask, segment_ids) for [B, T]: arbitrary masks, empty rows, empty batch."""
    mask = draw(hnp.arrays(bool, (B, T)))
    alive_rows = draw(hnp.arrays(bool, (B,)))
    alive_batch = draw(st.booleans())
    mask = mask & alive_rows[:, None] & alive_batch
    starts = draw(hnp.arrays(bool, (B, T)))
    starts[:, 0] = True
    segment_ids = np.where(mask, np.cumsum(starts, axis=1) - 1, -1).astype(np.int32)
    return mask, segment_ids


LOGP = hnp.arrays(
    np.float32,
    (B, T),
    elements=st.one_of(st.floats(-1e4, 0.0, width=32), st.floats(-3.0, 0.0, width=32)),
)
ADVANTAGES = hnp.arrays(np.float32, (B, T), elements=st.floats(-10.0, 10.0, width=32))


@functools.cache
def _ppo_grad(mode):
    def objective(logp, old_logp, advantages, mask, segment_ids):
        per_token = losses.ppo_clip_loss(logp, old_logp, advantages, dual_clip=3.0)
        return losses.aggregate_loss(per_token, mask, mode, segment_ids=segment_ids)

    return jax.jit(jax.grad(objective))


def _check_grad(grad, mask):
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~mask] == 0.0)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
@PROPERTY_SETTINGS
@given(batch=masked_batches(), logp=LOGP, old_logp=LOGP, advantages=ADVANTAGES)
def test_ppo_aggregate_gradients_finite_and_zero_when_masked(
    mode, batch, logp, old_logp, advantages
):
    mask, segment_ids = batch
    grad = _ppo_grad(mode)(logp, old_logp, advantages, mask, segment_ids)
    _check_grad(grad, mask)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_ppo_aggregate_gradients_all_masked_batch(mode):
    rng = np.random.default_rng(2)
    logp = rng.normal(scale=100.0, size=(B, T)).astype(np.float32)
    advantages = rng.normal(size=(B, T)).astype(np.float32)
    mask = np.zeros((B, T), bool)
    grad = _ppo_grad(mode)(logp, np.zeros_like(logp), advantages, mask, -np.ones((B, T), np.int32))
    assert np.all(np.asarray(grad) == 0.0)


def test_ppo_aggregate_gradient_is_nonzero_on_policy_tokens():
    # Guards the zero-gradient checks above against a vacuously-zero gradient.
    logp = np.full((B, T), -1.0, np.float32)
    mask = np.eye(B, T, dtype=bool)
    advantages = np.ones((B, T), np.float32)
    segment_ids = np.where(mask, 0, -1).astype(np.int32)
    for mode in losses.AGGREGATIONS:
        grad = np.asarray(_ppo_grad(mode)(logp, logp, advantages, mask, segment_ids))
        assert np.all(grad[mask] < 0.0), mode
        assert np.all(grad[~mask] == 0.0), mode


@jax.jit
@jax.grad
def _k3_grad(logp, ref_logp, mask):
    return losses.aggregate_loss(
        losses.kl_divergence(logp, ref_logp, "k3"), mask, "seq_mean_token_mean"
    )


@jax.jit
@jax.grad
def _value_grad(values, returns, old_values, mask):
    per_token = losses.value_loss(values, returns, old_values, clip_range=0.2)
    return losses.aggregate_loss(per_token, mask, "token_mean")


@PROPERTY_SETTINGS
@given(batch=masked_batches(), logp=LOGP, ref_logp=LOGP)
def test_k3_gradients_finite_and_zero_when_masked(batch, logp, ref_logp):
    mask, _ = batch
    _check_grad(_k3_grad(logp, ref_logp, mask), mask)


VALUES = hnp.arrays(np.float32, (B, T), elements=st.floats(-1e3, 1e3, width=32))


@PROPERTY_SETTINGS
@given(batch=masked_batches(), values=VALUES, returns=VALUES, old_values=VALUES)
def test_value_loss_gradients_finite_and_zero_when_masked(batch, values, returns, old_values):
    mask, _ = batch
    _check_grad(_value_grad(values, returns, old_values, mask), mask)
