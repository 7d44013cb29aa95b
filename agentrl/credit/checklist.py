"""CM2 checklist rewards and advantages at trajectory, turn and step level (SPEC §5).

Seed: `cm2_checklist_rewards.txt` §3.3 (eqs. 1–2, step rewards with
dependency gating and backfill), §3.4 (eqs. 3–9, the three advantage levels),
App. A.3 (defaults: `scale="none"`, G = 48, trajectory level).
"""

from typing import Literal, NamedTuple

import chex
import jax.numpy as jnp

from agentrl.numerics import (
    Scale,
    check_choice,
    float_dtype,
    group_normalize,
    group_statistics,
)

TurnNormalizer = Literal["reached", "reference"]


class ChecklistCredit(NamedTuple):
    """Outputs of `checklist_credit`; every entry is 0 where its mask is 0.

    Attributes:
      r: `[N, G, L, S, C]` step rewards `r[s, c]` (eq. 1).
      r_tilde: `[N, G, L, S, C]` backfilled step rewards `r̃[s, c]` (eq. 2).
      eligible: `[N, G, L, S, C]` bool, the eligible sets `E_s`.
      turn_reward: `[N, G, L]` `R_t` (eq. 5).
      traj_reward: `[N, G]` `R` (eq. 3).
      traj_adv: `[N, G]` trajectory advantage (eq. 4).
      turn_adv: `[N, G, L]` turn advantage (eq. 6).
      step_adv: `[N, G, L, S]` step advantage (eqs. 7–9).
    """

    r: chex.Array
    r_tilde: chex.Array
    eligible: chex.Array
    turn_reward: chex.Array
    traj_reward: chex.Array
    traj_adv: chex.Array
    turn_adv: chex.Array
    step_adv: chex.Array


def checklist_step_rewards(
    sat_after: chex.Array,
    deps: chex.Array,
    step_mask: chex.Array,
    item_mask: chex.Array,
) -> tuple[chex.Array, chex.Array, chex.Array]:
    """Dependency-gated step rewards `r` and backfilled `r̃` (SPEC §5.2–5.3, eqs. 1–2).

    `Sat(x_0) = 0`, `Sat(x_{s+1}) = Sat(x_s) ∨ sat_after[s]` (monotone);
    `E_s = {c : deps_ok(x_s)[c] ∧ ¬Sat(x_s)[c]}`;
    `r[s, c] = 1[c ∈ E_s ∧ Sat(x_{s+1})[c]]`, `r̃[s, c] = 1[c ∈ E_s ∧ Sat(x_S)[c]]`.

    Reading (SPEC §5.2): satisfaction is monotone, a judge flicker back to
    "unsatisfied" is ignored; an item satisfied while a prerequisite was still
    missing earns nothing, ever. Padded steps (step_mask 0) satisfy nothing;
    padded items are never eligible and do not gate other items.

    Args:
      sat_after: `[..., S, C]` bool judge verdicts after each step.
      deps: `[..., C, C]` bool, `deps[c, c'] = 1` iff c' is a prerequisite of c.
      step_mask: `[..., S]` bool valid steps.
      item_mask: `[..., C]` bool valid items.

    Returns:
      `(r, r_tilde, eligible)`, each `[..., S, C]` (r, r_tilde float of the
      default dtype; eligible bool).
    """
    chex.assert_equal_shape_prefix([sat_after, deps, step_mask, item_mask], sat_after.ndim - 2)
    step_valid = step_mask[..., :, None] & item_mask[..., None, :]
    sat_step = sat_after & step_valid
    sat_next = jnp.cumsum(sat_step.astype(jnp.int32), axis=-2) > 0  # Sat(x_{s+1})
    sat_prev = jnp.concatenate(  # Sat(x_s)
        [jnp.zeros_like(sat_next[..., :1, :]), sat_next[..., :-1, :]], axis=-2
    )
    sat_final = sat_next[..., -1:, :]  # Sat(x_S): padded steps add nothing
    prerequisites = (deps & item_mask[..., None, :]).astype(jnp.int32)
    missing = jnp.einsum("...cd,...sd->...sc", prerequisites, (~sat_prev).astype(jnp.int32))
    eligible = (missing == 0) & ~sat_prev & step_valid
    dtype = float_dtype()
    r = (eligible & sat_next).astype(dtype)
    r_tilde = (eligible & sat_final).astype(dtype)
    return r, r_tilde, eligible


def checklist_credit(
    sat_after: chex.Array,
    deps: chex.Array,
    weights: chex.Array,
    step_mask: chex.Array,
    item_mask: chex.Array,
    turn_mask: chex.Array,
    *,
    scale: Scale = "none",
    ddof: int = 1,
    eps: float = 1e-6,
    turn_normalizer: TurnNormalizer = "reached",
    reference_turns: chex.Array | None = None,
) -> ChecklistCredit:
    """CM2 checklist credit at all three levels (SPEC §5.3–5.4, seed eqs. 1–9).

    * Turn reward (eq. 5) `R_t = Σ_s Σ_c w_{t,c} r[s, c]` ∈ [0, 1].
    * Trajectory reward (eq. 3) `R = (1/L) Σ_t R_t`, L the number of turns this
      rollout reached (`turn_normalizer="reached"`, the paper's `L^(i)`), or the
      reference dialogue's turn count (`"reference"`: does not reward ending
      early, but penalises rollouts the strictness rule cut short).
    * Trajectory advantage (eq. 4): R group-normalised (SPEC §1).
    * Turn advantage (eq. 6): `R_t` normalised over the members reaching turn t.
    * Step advantage (eqs. 7–9): `hit_{i,t,c} = max_s r[s, c]` (0 for rollouts
      that did not reach t); `b_{t,c} = (1/G) Σ_i hit_{i,t,c}`;
      `A_{t,s,c} = (r̃[s, c] − b_{t,c}) / scale_i(hit_{·,t,c})`;
      `A_step[t, s] = Σ_{c∈E_s} w A_{t,s,c} / Σ_{c∈E_s} w`, 0 when E_s is empty.

    Reading (SPEC §5): monotone satisfaction (see `checklist_step_rewards`); a
    member with no valid turn is padding (not counted in G). Paper default
    `scale="none"` (App. A.3).

    Args:
      sat_after: `[N, G, L, S, C]` bool judge verdicts after each step.
      deps: `[N, G, L, C, C]` bool, `deps[..., c, c']` iff c' is a prerequisite of c.
      weights: `[N, G, L, C]` item weights `w_{t,c}` (Σ_c w = 1 per turn).
      step_mask: `[N, G, L, S]` bool valid steps of each turn.
      item_mask: `[N, G, L, C]` bool valid items of each turn.
      turn_mask: `[N, G, L]` bool turns the rollout reached.
      scale, ddof, eps: group normalisation (SPEC §1).
      turn_normalizer: `"reached"` or `"reference"`.
      reference_turns: `[N]` turn counts of the reference dialogues; required
        for `turn_normalizer="reference"`.

    Returns:
      A `ChecklistCredit`.
    """
    check_choice("turn_normalizer", turn_normalizer, ("reached", "reference"))
    dtype = float_dtype(weights)
    sat_after = jnp.asarray(sat_after, bool)
    deps = jnp.asarray(deps, bool)
    weights = jnp.asarray(weights, dtype)
    step_mask = jnp.asarray(step_mask, bool)
    item_mask = jnp.asarray(item_mask, bool)
    turn_mask = jnp.asarray(turn_mask, bool)
    chex.assert_rank([sat_after, deps, weights, step_mask, item_mask, turn_mask],
                     [5, 5, 4, 4, 4, 3])
    n, g, num_turns, num_steps, num_items = sat_after.shape
    chex.assert_shape(deps, (n, g, num_turns, num_items, num_items))
    chex.assert_shape([weights, item_mask], (n, g, num_turns, num_items))
    chex.assert_shape(step_mask, (n, g, num_turns, num_steps))
    chex.assert_shape(turn_mask, (n, g, num_turns))

    step_mask = step_mask & turn_mask[..., None]
    item_mask = item_mask & turn_mask[..., None]
    weights = jnp.where(item_mask, weights, 0.0)
    r, r_tilde, eligible = checklist_step_rewards(sat_after, deps, step_mask, item_mask)

    turn_reward = jnp.einsum("ngtsc,ngtc->ngt", r, weights)
    member_mask = turn_mask.any(axis=-1)
    if turn_normalizer == "reached":
        num_reached = turn_mask.sum(axis=-1).astype(dtype)
    else:
        if reference_turns is None:
            raise ValueError(
                "turn_normalizer='reference' needs reference_turns ([N] turn counts of the "
                "reference dialogues); pass it or use turn_normalizer='reached'."
            )
        reference_turns = jnp.asarray(reference_turns, dtype)
        chex.assert_shape(reference_turns, (n,))
        num_reached = jnp.broadcast_to(reference_turns[:, None], (n, g))
    traj_reward = jnp.where(member_mask, turn_reward.sum(-1) / jnp.maximum(num_reached, 1), 0.0)

    norm = dict(scale=scale, ddof=ddof, eps=eps)
    traj_adv = group_normalize(traj_reward, member_mask, axis=1, **norm)
    turn_adv = group_normalize(turn_reward, turn_mask, axis=1, **norm)

    hit = r.max(axis=3)  # [N, G, L, C]: 0 for turns not reached
    hit_mask = jnp.broadcast_to(member_mask[:, :, None, None], hit.shape)
    baseline, denominator, has_spread = group_statistics(hit, hit_mask, axis=1, **norm)
    item_adv = (r_tilde - baseline[:, :, :, None, :]) / denominator[:, :, :, None, :]
    item_adv = jnp.where(has_spread[:, :, :, None, :], item_adv, 0.0)
    eligible_weights = jnp.where(eligible, weights[:, :, :, None, :], 0.0)
    weight_sum = eligible_weights.sum(-1)
    step_adv = jnp.where(
        weight_sum > 0,
        (eligible_weights * item_adv).sum(-1) / jnp.where(weight_sum > 0, weight_sum, 1.0),
        0.0,
    )
    return ChecklistCredit(
        r=r,
        r_tilde=r_tilde,
        eligible=eligible,
        turn_reward=turn_reward,
        traj_reward=traj_reward,
        traj_adv=traj_adv,
        turn_adv=turn_adv,
        step_adv=jnp.where(step_mask, step_adv, 0.0),
    )
