"""GRPO and MT-GRPO advantages (SPEC §2, §3).

GRPO: Shao et al. 2024, as restated in the MT-GRPO seed
(`turn_level_credit_mt_grpo_mt_ppo.txt`, eq. 4; objective eq. 3). MT-GRPO: the same seed, §3.3
(eq. 6) and App. C (general K-turn form).
"""

import chex
import jax.numpy as jnp

from agentrl.numerics import Scale, float_dtype, group_normalize


def grpo_advantages(
    rewards: chex.Array,
    *,
    scale: Scale = "std",
    ddof: int = 1,
    eps: float = 1e-6,
    mask: chex.Array | None = None,
) -> chex.Array:
    """Group-normalised trajectory advantages (SPEC §2).

    `A_i = (R_i − mean_g R) / scale_g(R)`, with `scale_g = std(R, ddof) + eps`
    (`scale="std"`) or 1 (`scale="none"`, Dr. GRPO). One scalar per
    trajectory; broadcast it to the policy tokens with
    `agentrl.credit.trajectory_to_tokens`.

    Args:
      rewards: `[N, G]` trajectory rewards `R_i`, N prompts × G members.
      scale: `"std"` or `"none"`.
      ddof: delta degrees of freedom of the group standard deviation.
      eps: added to the standard deviation.
      mask: optional `[N, G]` bool; members with `mask = 0` are padding: not
        counted in the statistics, advantage 0.

    Returns:
      `[N, G]` advantages.
    """
    rewards = jnp.asarray(rewards, float_dtype(rewards))
    chex.assert_rank(rewards, 2)
    mask = jnp.ones(rewards.shape, bool) if mask is None else jnp.asarray(mask, bool)
    chex.assert_equal_shape([rewards, mask])
    return group_normalize(rewards, mask, axis=1, scale=scale, ddof=ddof, eps=eps)


def mt_grpo_advantages(
    turn_rewards: chex.Array,
    turn_mask: chex.Array,
    outcome: chex.Array,
    *,
    scale: Scale = "std",
    ddof: int = 1,
    eps: float = 1e-6,
) -> chex.Array:
    """Turn-level MT-GRPO advantages (SPEC §3; seed §3.3 eq. 6, App. C).

    With `K_i` the last valid turn of rollout i:

    * `A^out_i`: the outcome `R^O_i` group-normalised over the valid members.
    * `A^I_{i,k}`: `R^I_{i,k}` normalised over the members j for which k is an
      intermediate turn (`k < K_j`); 0 where k is not intermediate for i.
    * `Ā_{i,k} = A^out_i + Σ_{l=k}^{K_i−1} A^I_{i,l}` for every valid turn k.

    Reading (SPEC §3): the paper gives the two-turn case (`Ā_1 = A_1 + A_2`,
    `Ā_2 = A_2`) and a fixed-K case; this form reduces to both and stays
    defined when rollouts end at different turns. A member with no valid turn
    is padding. Known bias: when the policy decides how many turns it takes,
    per-turn-index statistics mix different states (verl-project/verl#7244).

    Args:
      turn_rewards: `[N, G, K]` intermediate turn rewards `R^I_{i,k}`; the value
        at the final turn is ignored (the outcome belongs to it).
      turn_mask: `[N, G, K]` bool, valid turns (a prefix of the K axis).
      outcome: `[N, G]` outcome rewards `R^O_i`.
      scale, ddof, eps: group normalisation (SPEC §1).

    Returns:
      `[N, G, K]` advantages, 0 on padded turns.
    """
    dtype = float_dtype(turn_rewards, outcome)
    turn_rewards = jnp.asarray(turn_rewards, dtype)
    outcome = jnp.asarray(outcome, dtype)
    turn_mask = jnp.asarray(turn_mask, bool)
    chex.assert_rank([turn_rewards, turn_mask, outcome], [3, 3, 2])
    chex.assert_equal_shape([turn_rewards, turn_mask])
    chex.assert_equal_shape_prefix([turn_rewards, outcome], 2)

    member_mask = turn_mask.any(axis=-1)
    outcome_adv = group_normalize(
        outcome, member_mask, axis=1, scale=scale, ddof=ddof, eps=eps
    )
    num_turns = turn_mask.sum(axis=-1, keepdims=True)
    turn_index = jnp.arange(turn_rewards.shape[-1])[None, None, :]
    intermediate = turn_mask & (turn_index < num_turns - 1)
    intermediate_adv = group_normalize(
        turn_rewards, intermediate, axis=1, scale=scale, ddof=ddof, eps=eps
    )
    # Σ_{l=k}^{K_i−1} A^I_{i,l}: a reverse cumulative sum (A^I is 0 from K_i on).
    future_intermediate = jnp.flip(jnp.cumsum(jnp.flip(intermediate_adv, -1), -1), -1)
    return jnp.where(turn_mask, outcome_adv[..., None] + future_intermediate, 0.0)
