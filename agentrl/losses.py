"""Per-token policy and critic losses, and their named reductions (SPEC §10).

Elementwise functions (`ppo_clip_loss`, `kl_divergence`, `entropy_from_logits`,
`value_loss`, `truncated_importance_weights`) take no mask and compute every
position; `aggregate_loss` applies the mask (SPEC §1, "Masked positions").
"""

from typing import Literal

import chex
import jax
import jax.numpy as jnp

from agentrl.numerics import check_choice, float_dtype, masked_mean

Aggregation = Literal[
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "segment_mean_sum",
]
AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "segment_mean_sum",
)
KLKind = Literal["k1", "abs", "k2", "k3"]
KL_KINDS = ("k1", "abs", "k2", "k3")
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _floats(*arrays):
    dtype = float_dtype(*arrays)
    return [jnp.asarray(a, dtype) for a in arrays]


def log_ratio(logp: chex.Array, old_logp: chex.Array) -> chex.Array:
    """`logp − old_logp` clamped to ±20 so `exp` never overflows (SPEC §10)."""
    return jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ppo_clip_loss(
    logp: chex.Array,
    old_logp: chex.Array,
    advantages: chex.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> chex.Array:
    """Per-token PPO clipped surrogate loss (SPEC §10; Schulman et al. 2017, eq. 7).

    `ℓ = max(−A r, −A clip(r, 1 − ε_low, 1 + ε_high))`, `r = exp(logp − old_logp)`
    with the log-ratio clamped to ±20. Asymmetric clipping (`clip_high >
    clip_low`, "clip-higher", DAPO) is allowed. Dual clip (Ye et al. 2020) with
    `c = dual_clip > 1`: for `A < 0`, `ℓ = min(ℓ, −A c)`.

    Args:
      logp: `[B, T]` log-probabilities under the current policy.
      old_logp: `[B, T]` log-probabilities under the behaviour policy.
      advantages: `[B, T]` per-token advantages.
      clip_low: ε_low.
      clip_high: ε_high.
      dual_clip: c > 1, or None to disable.

    Returns:
      `[B, T]` per-token losses (unmasked; reduce with `aggregate_loss`).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip!r} must be > 1 (e.g. 3.0) or None.")
    logp, old_logp, advantages = _floats(logp, old_logp, advantages)
    chex.assert_equal_shape([logp, old_logp, advantages])
    ratio = jnp.exp(log_ratio(logp, old_logp))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -advantages * dual_clip), loss)
    return loss


def _segment_mean_sum(per_token, mask, segment_ids):
    """Per row: Σ over segments of the mean over the segment's tokens (SPEC §9.3)."""
    batch, length = per_token.shape
    valid = mask & (segment_ids >= 0) & (segment_ids < length)
    flat_ids = jnp.where(valid, jnp.arange(batch)[:, None] * length + segment_ids, batch * length)
    num_segments = batch * length
    sums = jax.ops.segment_sum(
        jnp.where(valid, per_token, 0.0).ravel(), flat_ids.ravel(), num_segments + 1
    )[:num_segments]
    counts = jax.ops.segment_sum(
        valid.astype(per_token.dtype).ravel(), flat_ids.ravel(), num_segments + 1
    )[:num_segments]
    segment_means = sums / jnp.maximum(counts, 1)
    return segment_means.reshape(batch, length).sum(axis=1)


def aggregate_loss(
    per_token: chex.Array,
    mask: chex.Array,
    mode: Aggregation,
    *,
    segment_ids: chex.Array | None = None,
    norm_length: int | None = None,
) -> chex.Array:
    """Reduce per-token losses to a scalar (SPEC §10, §9.3).

    * `token_mean`: Σ masked / number of policy tokens in the batch.
    * `seq_mean_token_mean`: per row the mean over its tokens, then the mean
      over non-empty rows.
    * `seq_mean_token_sum`: per row the sum, then the mean over non-empty rows.
    * `seq_mean_token_sum_norm`: Σ masked / (B × `norm_length`), every row
      counted, empty ones too (Dr. GRPO).
    * `segment_mean_sum`: per row, Σ over segments of the mean over the
      segment's tokens, then the mean over non-empty rows (CARL §3).

    An empty batch gives 0, never a division by zero.

    Args:
      per_token: `[B, T]` per-token losses.
      mask: `[B, T]` bool, the tokens that count.
      mode: one of the five modes above.
      segment_ids: `[B, T]` int segment index of each token (−1 on padding);
        required for `segment_mean_sum`.
      norm_length: the constant length of `seq_mean_token_sum_norm`; defaults
        to T.

    Returns:
      Scalar.
    """
    check_choice("mode", mode, AGGREGATIONS)
    (per_token,) = _floats(per_token)
    mask = jnp.asarray(mask, bool)
    chex.assert_rank(per_token, 2)
    chex.assert_equal_shape([per_token, mask])
    masked = jnp.where(mask, per_token, 0.0)
    non_empty = mask.any(axis=1)
    if mode == "token_mean":
        return masked.sum() / jnp.maximum(mask.sum(), 1)
    if mode == "seq_mean_token_mean":
        return masked_mean(masked_mean(per_token, mask, axis=1), non_empty, axis=0)
    if mode == "seq_mean_token_sum":
        return masked_mean(masked.sum(axis=1), non_empty, axis=0)
    if mode == "seq_mean_token_sum_norm":
        length = per_token.shape[1] if norm_length is None else norm_length
        return masked.sum() / (per_token.shape[0] * length)
    if segment_ids is None:
        raise ValueError(
            "aggregate_loss(mode='segment_mean_sum') needs segment_ids ([B, T] int, the "
            "segment of each token, -1 on padding); pass the batch's step_id."
        )
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    chex.assert_equal_shape([per_token, segment_ids])
    return masked_mean(_segment_mean_sum(per_token, mask, segment_ids), non_empty, axis=0)


def kl_divergence(logp: chex.Array, ref_logp: chex.Array, kind: KLKind = "k3") -> chex.Array:
    """Per-token KL estimate to the reference policy (SPEC §10; Schulman 2020).

    With `d = logp − ref_logp`: `k1 = d`, `abs = |d|`, `k2 = d²/2`,
    `k3 = exp(−d) − 1 + d`, `−d` clamped to [−20, 20] before the exp and the
    result clamped to [−10, 10]. Usable as a loss term or a reward penalty.

    Args:
      logp: `[B, T]` current-policy log-probabilities.
      ref_logp: `[B, T]` reference-policy log-probabilities.
      kind: `"k1"`, `"abs"`, `"k2"` or `"k3"`.

    Returns:
      `[B, T]` per-token estimates (unmasked).
    """
    check_choice("kind", kind, KL_KINDS)
    logp, ref_logp = _floats(logp, ref_logp)
    chex.assert_equal_shape([logp, ref_logp])
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "abs":
        return jnp.abs(d)
    if kind == "k2":
        return 0.5 * d**2
    neg_d = jnp.clip(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # expm1, not exp − 1: in float32 the latter rounds below −d for small |d| (k3 < 0).
    return jnp.clip(jnp.expm1(neg_d) - neg_d, -K3_CLAMP, K3_CLAMP)


def entropy_from_logits(logits: chex.Array) -> chex.Array:
    """Per-token entropy `H = logsumexp(z) − Σ_v softmax(z)_v z_v` (SPEC §10).

    Args:
      logits: `[..., V]`.

    Returns:
      `[...]` entropies in nats (unmasked).
    """
    (logits,) = _floats(logits)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -(jnp.exp(log_probs) * log_probs).sum(axis=-1)


def value_loss(
    values: chex.Array,
    returns: chex.Array,
    old_values: chex.Array | None = None,
    *,
    clip_range: float | None = None,
) -> chex.Array:
    """Per-position squared-error value loss with optional PPO value clipping (SPEC §10).

    `ℓ = (V − R)²`; with `clip_range = ε_v` and the rollout-time values `V_old`,
    `ℓ = max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²)`.

    Args:
      values: `[B, T]` current critic values.
      returns: `[B, T]` targets.
      old_values: `[B, T]` critic values at rollout time; needed for clipping.
      clip_range: ε_v, or None for no clipping.

    Returns:
      `[B, T]` per-position losses (unmasked).
    """
    values, returns = _floats(values, returns)
    chex.assert_equal_shape([values, returns])
    loss = (values - returns) ** 2
    if clip_range is None:
        return loss
    if old_values is None:
        raise ValueError("value_loss(clip_range=...) needs old_values, the rollout-time values.")
    (old_values,) = _floats(old_values)
    chex.assert_equal_shape([values, old_values])
    clipped = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
    return jnp.maximum(loss, (clipped - returns) ** 2)


def truncated_importance_weights(
    old_logp: chex.Array, rollout_logp: chex.Array, *, cap: float = 2.0
) -> chex.Array:
    """Truncated IS weights for rollout/trainer mismatch (SPEC §10).

    `w = min(exp(old_logp − rollout_logp), C)` per token, the log-ratio clamped
    to ±20; multiply the per-token policy loss by `stop_gradient(w)`. Off by
    default in the trainer.

    Args:
      old_logp: `[B, T]` trainer log-probabilities of the behaviour policy.
      rollout_logp: `[B, T]` the engine's log-probabilities of the same tokens.
      cap: C.

    Returns:
      `[B, T]` weights in (0, C].
    """
    old_logp, rollout_logp = _floats(old_logp, rollout_logp)
    chex.assert_equal_shape([old_logp, rollout_logp])
    return jnp.minimum(jnp.exp(log_ratio(old_logp, rollout_logp)), cap)
