"""CARL segment-level advantages and Monte-Carlo critic loss (SPEC §9).

Seed: `carl_segment_credit.txt` §3 (eqs. 1–2, segment TD advantages over
boundary states), App. A (λ variants), §3 / App. B (critic loss, value head).
"""

import chex
import jax.numpy as jnp

from agentrl.numerics import float_dtype, masked_mean


def _segment_inputs(values, seg_mask, reward):
    dtype = float_dtype(values, reward)
    values = jnp.asarray(values, dtype)
    seg_mask = jnp.asarray(seg_mask, bool)
    reward = jnp.asarray(reward, dtype)
    chex.assert_rank([values, seg_mask, reward], [2, 2, 1])
    chex.assert_equal_shape([values, seg_mask])
    chex.assert_equal_shape_prefix([values, reward], 1)
    return values, seg_mask, reward


def segment_advantages(
    values: chex.Array,
    seg_mask: chex.Array,
    reward: chex.Array,
    *,
    gamma: float = 1.0,
    lambda_: float = 0.0,
) -> chex.Array:
    """Segment-level GAE over boundary values (SPEC §9.2; seed eqs. 1–2, App. A).

    `V[b, k]` is the critic at the boundary state before segment k (transient
    states included). `δ_k = γ V_{k+1} − V_k` for non-final segments,
    `δ_N = R − V_N` for the final one, `A_k = Σ_l (γλ)^l δ_{k+l}`.
    Defaults `γ = 1, λ = 0` (one-step TD). At λ = 0 the advantages telescope,
    `Σ_k A_k = R − V_0`; at λ = 1 (γ = 1) every `A_k = R − V_k`.

    Args:
      values: `[B, S]` boundary values.
      seg_mask: `[B, S]` bool valid segments (a prefix).
      reward: `[B]` terminal reward R.
      gamma: discount γ.
      lambda_: λ.

    Returns:
      `[B, S]` advantages, 0 on padded segments.
    """
    values, seg_mask, reward = _segment_inputs(values, seg_mask, reward)
    num_segments = values.shape[1]
    is_final = seg_mask & ~jnp.concatenate(
        [seg_mask[:, 1:], jnp.zeros_like(seg_mask[:, :1])], axis=1
    )
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = jnp.where(is_final, reward[:, None], gamma * next_values) - values
    deltas = jnp.where(seg_mask, deltas, 0.0)
    # A = δ M with M[l, k] = (γλ)^{l−k} for l ≥ k: S ≤ 15 in CARL, so a small
    # matmul beats a scan.
    index = jnp.arange(num_segments)
    lag = index[:, None] - index[None, :]
    decay = jnp.where(lag >= 0, (gamma * lambda_) ** jnp.maximum(lag, 0), 0.0)
    decay = jnp.where(lag == 0, 1.0, decay).astype(values.dtype)
    return jnp.where(seg_mask, deltas @ decay, 0.0)


def segment_critic_loss(
    values: chex.Array, seg_mask: chex.Array, reward: chex.Array
) -> chex.Array:
    """Monte-Carlo critic loss over boundary states (SPEC §9.3; seed §3).

    Per trajectory `(1/(N+1)) Σ_k (V_k − R)²` over its N + 1 valid boundary
    values (the boundaries before each valid segment), then the mean over the
    trajectories that have any valid segment (0 for an empty batch).

    Args:
      values: `[B, S]` boundary values.
      seg_mask: `[B, S]` bool valid segments (a prefix).
      reward: `[B]` terminal reward R.

    Returns:
      Scalar loss.
    """
    values, seg_mask, reward = _segment_inputs(values, seg_mask, reward)
    per_trajectory = masked_mean((values - reward[:, None]) ** 2, seg_mask, axis=1)
    return masked_mean(per_trajectory, seg_mask.any(axis=1), axis=0)
