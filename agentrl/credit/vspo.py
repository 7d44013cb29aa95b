"""VSPO: value-based resampling of zero-variance groups (SPEC §8).

Seed: `prs_vspo.txt`, "VSPO" (group value, eq. 18; sampling probabilities, eq. 19;
eq. 20, copies as an N× advantage; eq. 21, value smoothing). Paper settings:
T = 0.1, α = 2, 5 rollouts per prompt.
"""

import chex
import jax
import jax.numpy as jnp

from agentrl.numerics import float_dtype


def vspo_value_scores(rewards: chex.Array) -> tuple[chex.Array, chex.Array]:
    """Group value `V_x = (R_max − μ_x) σ²_x` and variance (SPEC §8; seed eq. 18).

    `μ_x` and the population variance `σ²_x` (1/n) are per group; `R_max` is
    the largest reward of the whole batch.

    Args:
      rewards: `[N, G]` rewards, one row per group.

    Returns:
      `(value [N], variance [N])`.
    """
    rewards = jnp.asarray(rewards, float_dtype(rewards))
    chex.assert_rank(rewards, 2)
    mean = rewards.mean(axis=1)
    variance = ((rewards - mean[:, None]) ** 2).mean(axis=1)
    return (rewards.max() - mean) * variance, variance


def vspo_probabilities(
    rewards: chex.Array, *, temperature: float = 0.1, var_eps: float = 1e-6
) -> tuple[chex.Array, chex.Array]:
    """Sampling probabilities `p_x = softmax(V_x / T)` over live groups (SPEC §8; seed eq. 19).

    A group is live (non-zero variance) when `σ²_x > var_eps`. Dead groups get
    probability 0; if no group is live, `p` is all zeros.

    Args:
      rewards: `[N, G]` rewards.
      temperature: T.
      var_eps: zero-variance threshold.

    Returns:
      `(probs [N], live [N] bool)`.
    """
    value, variance = vspo_value_scores(rewards)
    live = variance > var_eps
    logits = jnp.where(live, value / temperature, -jnp.inf)
    shifted = jnp.where(live, logits - jnp.max(jnp.where(live, logits, -1e30)), -jnp.inf)
    weights = jnp.where(live, jnp.exp(shifted), 0.0)
    probs = weights / jnp.maximum(weights.sum(), jnp.finfo(weights.dtype).tiny)
    return probs, live


def vspo_slot_weights(slot_to_group: chex.Array, *, alpha: float = 2.0) -> chex.Array:
    """Value-smoothing weight of each slot (SPEC §8; seed eq. 21).

    A group filling `N_x` slots gets total weight `ω_x = α − (α − 1)/N_x`
    instead of `N_x`: each of its copies carries `ω_x / N_x`.

    Reading (SPEC §8): eq. 20 shows N copies act as an N× advantage, which eq. 21
    replaces by ω ∈ [1, α); scaling each copy by ω would enlarge it instead.

    Args:
      slot_to_group: `[N]` int, the group each slot holds.
      alpha: α ≥ 1.

    Returns:
      `[N]` weights; 1 for groups that fill one slot.
    """
    slot_to_group = jnp.asarray(slot_to_group, jnp.int32)
    chex.assert_rank(slot_to_group, 1)
    num_slots = slot_to_group.shape[0]
    copies = jnp.zeros(num_slots, jnp.int32).at[slot_to_group].add(1)[slot_to_group]
    copies = copies.astype(float_dtype())
    return (alpha - (alpha - 1.0) / copies) / copies


def vspo_resample(
    rewards: chex.Array,
    key: chex.PRNGKey,
    *,
    temperature: float = 0.1,
    alpha: float = 2.0,
    var_eps: float = 1e-6,
) -> tuple[chex.Array, chex.Array]:
    """Refill zero-variance group slots by value-based sampling (SPEC §8).

    Each zero-variance slot (`σ²_x ≤ var_eps`) gets a copy of a group drawn
    with replacement from `p = softmax(V / T)` over the live groups; live
    slots keep their group. If no group or every group is live, the batch is
    unchanged (identity, weights 1). Weights follow `vspo_slot_weights`.
    The trainer gathers the batch's group rows with `slot_to_group` and
    multiplies their advantages by `slot_weight`.

    Args:
      rewards: `[N, G]` rewards.
      key: PRNG key.
      temperature: T.
      alpha: α of the value smoothing.
      var_eps: zero-variance threshold.

    Returns:
      `(slot_to_group [N] int32, slot_weight [N])`.
    """
    probs, live = vspo_probabilities(rewards, temperature=temperature, var_eps=var_eps)
    num_groups = live.shape[0]
    identity = jnp.arange(num_groups, dtype=jnp.int32)
    draws = jax.random.choice(key, num_groups, shape=(num_groups,), p=probs).astype(jnp.int32)
    resample = live.any() & ~live.all()
    slot_to_group = jnp.where(resample & ~live, draws, identity)
    return slot_to_group, vspo_slot_weights(slot_to_group, alpha=alpha)
