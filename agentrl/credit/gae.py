"""Token-level GAE with observation masking, and MT-PPO reward placement (SPEC §4).

Seed: `turn_level_credit_mt_grpo_mt_ppo.txt` §4 (MT-PPO), §5.2 and App. B.2
(reward placement, `γ = λ = 1`); GAE: Schulman et al. 2016, eq. 16.
"""

import chex
import jax
import jax.numpy as jnp

from agentrl.credit.broadcast import last_token_positions
from agentrl.numerics import check_choice, float_dtype, masked_mean


def reverse_linear_recurrence(
    decay: chex.Array, inputs: chex.Array, *, method: str = "auto"
) -> chex.Array:
    """Solves `x_t = inputs_t + decay_t · x_{t+1}` backwards, `x_T = 0`, on the last axis.

    Two exact algorithms: `"scan"`, a T-step `lax.scan` (fastest on CPU), and
    `"associative"`, an associative scan of depth log T (the pair
    `(decay, input)` is the affine map `x ↦ input + decay · x`, and composing
    affine maps is associative; fastest on accelerators, where T sequential
    steps would be T kernel launches). `"auto"` picks by the default backend.

    Args:
      decay: `[..., T]` float.
      inputs: `[..., T]` float.
      method: `"auto"`, `"scan"` or `"associative"`.

    Returns:
      `[..., T]` the solution `x`.
    """
    check_choice("method", method, ("auto", "scan", "associative"))
    dtype = float_dtype(decay, inputs)
    decay, inputs = jnp.asarray(decay, dtype), jnp.asarray(inputs, dtype)
    chex.assert_equal_shape([decay, inputs])
    if method == "auto":
        method = "scan" if jax.default_backend() == "cpu" else "associative"
    if method == "scan":

        def step(carry, decay_and_input):
            decay_t, input_t = decay_and_input
            carry = input_t + decay_t * carry
            return carry, carry

        time_major = (jnp.moveaxis(decay, -1, 0), jnp.moveaxis(inputs, -1, 0))
        init = jnp.zeros(inputs.shape[:-1], inputs.dtype)
        _, solution = jax.lax.scan(step, init, time_major, reverse=True)
        return jnp.moveaxis(solution, 0, -1)

    def compose(later, earlier):
        # `later` covers positions after `earlier`'s; apply `later` first.
        decay_later, input_later = later
        decay_earlier, input_earlier = earlier
        return decay_earlier * decay_later, input_earlier + decay_earlier * input_later

    _, solution = jax.lax.associative_scan(
        compose, (decay, inputs), reverse=True, axis=decay.ndim - 1
    )
    return solution


def next_policy_values(values: chex.Array, mask: chex.Array) -> chex.Array:
    """`V` at the next policy position after t (0 after the last one).

    Args:
      values: `[B, T]` critic values.
      mask: `[B, T]` bool policy-token mask.

    Returns:
      `[B, T]`: for each t, `values[b, u]` with u the smallest `u > t` where
      `mask[b, u]`, or 0 if there is none.
    """
    values, mask = jnp.asarray(values, float_dtype(values)), jnp.asarray(mask, bool)
    chex.assert_equal_shape([values, mask])
    length = values.shape[-1]
    positions = jnp.where(mask, jnp.arange(length, dtype=jnp.int32), length)
    first_at_or_after = jax.lax.cummin(positions, axis=positions.ndim - 1, reverse=True)
    first_after = jnp.concatenate(
        [first_at_or_after[..., 1:], jnp.full_like(first_at_or_after[..., :1], length)], axis=-1
    )
    padded = jnp.concatenate([values, jnp.zeros_like(values[..., :1])], axis=-1)
    return jnp.take_along_axis(padded, first_after, axis=-1)


def gae_advantages(
    rewards: chex.Array,
    values: chex.Array,
    mask: chex.Array,
    *,
    gamma: float = 1.0,
    lambda_: float = 1.0,
) -> tuple[chex.Array, chex.Array]:
    """GAE over policy tokens, skipping environment tokens (SPEC §4).

    Over the policy positions `t_1 < t_2 < …` of a row (those with `mask = 1`):
    `δ_t = r_t + γ V(next policy position) − V_t` (the value after the last
    policy token is 0), `A_t = δ_t + γλ A_{next policy position}`.
    Positions with `mask = 0` neither add a TD step nor break the chain: the
    next policy position's value and advantage are carried across them, as
    verl does for observation tokens. Their rewards are ignored.
    `returns = A + V` at policy positions; both are 0 where `mask = 0`.
    With `mask` all ones this is textbook GAE (Schulman et al. 2016, eq. 16).
    MT-PPO (seed §4, App. B.2) uses `γ = λ = 1` with rewards placed by
    `mt_ppo_token_rewards`.

    Args:
      rewards: `[B, T]` per-token rewards.
      values: `[B, T]` critic values `V_t`.
      mask: `[B, T]` bool, 1 on policy tokens.
      gamma: discount γ.
      lambda_: GAE λ.

    Returns:
      `(advantages, returns)`, both `[B, T]`.
    """
    dtype = float_dtype(rewards, values)
    rewards = jnp.asarray(rewards, dtype)
    values = jnp.asarray(values, dtype)
    mask = jnp.asarray(mask, bool)
    chex.assert_rank([rewards, values, mask], 2)
    chex.assert_equal_shape([rewards, values, mask])

    weight = mask.astype(dtype)
    deltas = weight * (rewards + gamma * next_policy_values(values, mask) - values)
    # Masked positions pass the accumulated advantage through unchanged (decay 1).
    decay = jnp.where(mask, gamma * lambda_, 1.0).astype(dtype)
    advantages = weight * reverse_linear_recurrence(decay, deltas)
    returns = weight * (advantages + values)
    return advantages, returns


def whiten_advantages(
    advantages: chex.Array, mask: chex.Array, *, eps: float = 1e-8, shift_mean: bool = True
) -> chex.Array:
    """Masked batch whitening `(A − mean) / sqrt(var + eps)` (SPEC §4).

    Mean and the unbiased variance (`ddof = 1`) are taken over the whole batch's
    policy tokens; outputs are 0 where `mask = 0`. With `shift_mean=False` the
    mean is added back (scale-only whitening).

    Args:
      advantages: `[B, T]`.
      mask: `[B, T]` bool.
      eps: added to the variance.
      shift_mean: subtract the mean (default) or keep it.

    Returns:
      `[B, T]` whitened advantages.
    """
    mask = jnp.asarray(mask, bool)
    advantages = jnp.asarray(advantages, float_dtype(advantages))
    chex.assert_equal_shape([advantages, mask])
    axes = tuple(range(advantages.ndim))
    count = mask.sum()
    mean = masked_mean(advantages, mask, axes)
    centred = jnp.where(mask, advantages - mean, 0.0)
    var = (centred**2).sum() / jnp.maximum(count - 1, 1)
    whitened = centred * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(mask, whitened, 0.0)


def mt_ppo_token_rewards(
    final_reward: chex.Array,
    turn_rewards: chex.Array,
    turn_mask: chex.Array,
    turn_id: chex.Array,
    loss_mask: chex.Array,
) -> chex.Array:
    """MT-PPO reward placement (SPEC §4; seed §4, App. B.2).

    `R^F` is added at the last policy token of the trajectory; each
    intermediate turn reward `R^I_k` (k < K, K the last valid turn) at the last
    policy token of turn k. All other positions get 0.

    Args:
      final_reward: `[B]` `R^F`.
      turn_rewards: `[B, K]` `R^I_k`; the final turn's entry is ignored.
      turn_mask: `[B, K]` bool, valid turns (a prefix).
      turn_id: `[B, T]` int, turn of each token (−1 off-policy).
      loss_mask: `[B, T]` bool policy-token mask.

    Returns:
      `[B, T]` token rewards for `gae_advantages`.
    """
    dtype = float_dtype(final_reward, turn_rewards)
    final_reward = jnp.asarray(final_reward, dtype)
    turn_rewards = jnp.asarray(turn_rewards, dtype)
    loss_mask = jnp.asarray(loss_mask, bool)
    turn_mask = jnp.asarray(turn_mask, bool)
    turn_id = jnp.asarray(turn_id, jnp.int32)
    chex.assert_rank([final_reward, turn_rewards, turn_mask, turn_id, loss_mask],
                     [1, 2, 2, 2, 2])
    chex.assert_equal_shape([turn_rewards, turn_mask])
    chex.assert_equal_shape([turn_id, loss_mask])
    batch, length = loss_mask.shape
    num_turns = turn_rewards.shape[1]

    last_of_turn = last_token_positions(turn_id, loss_mask, num_turns)
    num_valid_turns = turn_mask.sum(axis=1, keepdims=True)
    intermediate = (
        turn_mask & (jnp.arange(num_turns)[None, :] < num_valid_turns - 1) & (last_of_turn >= 0)
    )
    placed_turn_rewards = jnp.where(intermediate, turn_rewards, 0.0)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, num_turns))
    token_rewards = jnp.zeros((batch, length), dtype)
    token_rewards = token_rewards.at[rows, jnp.where(intermediate, last_of_turn, length)].add(
        placed_turn_rewards, mode="drop"
    )
    positions = jnp.arange(length)
    last_policy = jnp.max(jnp.where(loss_mask, positions, -1), axis=1)
    at_last = positions[None, :] == last_policy[:, None]
    return token_rewards + jnp.where(at_last, final_reward[:, None], 0.0)
