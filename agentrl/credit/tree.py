"""PORTool rewarded-tree credit: step rewards, fork and trajectory advantages (SPEC §6).

Seed: `portool_rewarded_tree.txt` §3.2 (eq. 2, step reward; eq. 3, advantage),
Theorem 3.1 (the fork weight `w2`), Algorithm 1 (tree rollout, node sharing),
App. A–C (settings: n = 8, γ = 0.95, no KL, LoRA r = 16, α = 8).
"""

from typing import Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp

from agentrl.numerics import (
    Scale,
    check_choice,
    float_dtype,
    group_normalize,
    group_statistics,
)

Rule = Literal["portool", "max", "avg", "mix2"]
Weighting = Literal["theorem", "traj_only", "fork_only", "no_scale"]
RULES = ("portool", "max", "avg", "mix2")
WEIGHTINGS = ("theorem", "traj_only", "fork_only", "no_scale")
TIE_TOLERANCE = 1e-6


class TreeCredit(NamedTuple):
    """Outputs of `tree_credit`; 0 on padded steps.

    Attributes:
      step_adv: `[N, n, S]` the advantage of trajectory j at its step t (eq. 3).
      node_reward: `[N, n, S]` `R(s)` of the node at (j, t) (eq. 2).
      fork_adv: `[N, n, S]` `A_fork(s)` of the node at (j, t).
      traj_adv: `[N, n]` `A_trj(τ_j)`.
    """

    step_adv: chex.Array
    node_reward: chex.Array
    fork_adv: chex.Array
    traj_adv: chex.Array


def _safe_divide(numerator: chex.Array, denominator: chex.Array) -> chex.Array:
    """`numerator / denominator`, 0 where the denominator is 0."""
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0.0)


def _query_tree_credit(
    node_id, step_mask, outcome, fmt_score, step_tokens, *,
    gamma, fmt_bound, rule, weighting, scale, ddof, eps,
):
    """`tree_credit` for one query: `node_id [n, S]`, `outcome [n]`, ..."""
    n, num_steps = node_id.shape
    dtype = outcome.dtype
    valid = step_mask & (node_id >= 0)
    depth = jnp.arange(num_steps)
    traj_valid = valid.any(axis=-1)
    num_traj_steps = valid.sum(axis=-1)  # T_k
    traj_tokens = jnp.where(valid, step_tokens, 0).sum(axis=-1).astype(dtype)  # |τ_k|

    # same[j, k, t]: trajectories j and k pass through the same node at depth t.
    both_valid = valid[:, None, :] & valid[None, :, :]
    same = both_valid & (node_id[:, None, :] == node_id[None, :, :])
    earlier = jnp.arange(n)[:, None] < jnp.arange(n)[None, :]  # earlier[k, j] = k < j
    is_rep = valid & ~(same & earlier[:, :, None]).any(axis=0)
    rep = jnp.argmax(same, axis=1)  # lowest-index trajectory through the node: [n, S]
    node_fmt = jnp.take_along_axis(fmt_score, rep, axis=0)
    node_tokens = jnp.take_along_axis(step_tokens, rep, axis=0).astype(dtype)
    traversals = same.sum(axis=1).astype(dtype)  # |m(s)|

    # Siblings: same parent node (the root for depth 0), distinct nodes only.
    parent_id = jnp.concatenate([jnp.zeros_like(node_id[:, :1]), node_id[:, :-1]], axis=1)
    same_parent = (parent_id[:, None, :] == parent_id[None, :, :]) | (depth == 0)[None, None, :]
    sibling = both_valid & same_parent
    distinct_sibling = sibling & is_rep[None, :, :]
    num_children = distinct_sibling.sum(axis=1)  # |C(parent(s))|
    is_fork_child = num_children >= 2

    # Trajectory part (eq. 3): mean A_trj over the trajectories through the node.
    traj_adv = group_normalize(outcome, traj_valid, axis=0, scale=scale, ddof=ddof, eps=eps)
    traj_part = _safe_divide(jnp.einsum("jkt,k->jt", same.astype(dtype), traj_adv), traversals)

    # Step reward (eq. 2): v_k = γ^{T_k − 1 − t} R_out(τ_k) + R_fm(s).
    exponent = jnp.maximum(num_traj_steps[:, None] - 1 - depth[None, :], 0)
    discounted = gamma ** exponent.astype(dtype) * outcome[:, None]  # [n(k), S]
    outcome_max = jnp.where(same, discounted[None], -jnp.inf).max(axis=1)
    outcome_mean = _safe_divide(
        jnp.where(same, discounted[None], 0.0).sum(axis=1), traversals
    )
    format_reward = fmt_bound * (2.0 * node_fmt - 1.0)
    if rule == "avg":
        node_reward = outcome_mean + format_reward
    elif rule == "max":
        node_reward = outcome_max + format_reward
    else:
        # Tie rule on forks (SPEC §6.2): on the full reward ("portool") or on
        # the outcome part only ("mix2").
        tie_key = outcome_max + format_reward if rule == "portool" else outcome_max
        tie_key = jnp.where(valid, tie_key, 0.0)
        sibling_max = jnp.where(distinct_sibling, tie_key[None], -jnp.inf).max(axis=1)
        sibling_min = jnp.where(distinct_sibling, tie_key[None], jnp.inf).min(axis=1)
        tied = is_fork_child & (sibling_max - sibling_min <= TIE_TOLERANCE)
        node_reward = jnp.where(tied, outcome_mean, outcome_max) + format_reward
    node_reward = jnp.where(valid, node_reward, 0.0)

    # Fork advantage: z-score of R(s) over the distinct children of its parent.
    sibling_rewards = jnp.broadcast_to(node_reward[None], (n, n, num_steps))
    mean, denominator, has_spread = group_statistics(
        sibling_rewards, distinct_sibling, axis=1, scale=scale, ddof=ddof, eps=eps
    )
    fork_adv = jnp.where(
        valid & has_spread[:, 0], (node_reward - mean[:, 0]) / denominator[:, 0], 0.0
    )

    # N_forks: nodes (root included) with > 1 distinct child, counted at their
    # first child (the lowest trajectory index among the siblings).
    first_child = is_rep & ~(sibling & earlier.T[:, :, None]).any(axis=1)
    num_forks = (first_child & is_fork_child).sum().astype(dtype)

    fork_weight = _safe_divide(
        traj_valid.sum().astype(dtype) * traj_tokens[:, None],
        traversals * node_tokens * num_children.astype(dtype) * num_forks,
    )
    fork_weight = jnp.where(fork_adv != 0, fork_weight, 0.0)
    w_traj, w_fork = {
        "theorem": (1.0, fork_weight),
        "traj_only": (1.0, 0.0),
        "fork_only": (0.0, fork_weight),
        "no_scale": (1.0, 1.0),
    }[weighting]
    step_adv = jnp.where(valid, w_traj * traj_part + w_fork * fork_adv, 0.0)
    traj_adv = jnp.where(traj_valid, traj_adv, 0.0)
    return TreeCredit(step_adv, node_reward, fork_adv, traj_adv)


def tree_credit(
    node_id: chex.Array,
    step_mask: chex.Array,
    outcome: chex.Array,
    fmt_score: chex.Array,
    step_tokens: chex.Array,
    *,
    gamma: float = 0.95,
    fmt_bound: float = 0.25,
    rule: Rule = "portool",
    weighting: Weighting = "theorem",
    scale: Scale = "std",
    ddof: int = 1,
    eps: float = 1e-6,
) -> TreeCredit:
    """PORTool tree credit (SPEC §6.2–6.3; seed eq. 2, eq. 3, Theorem 3.1).

    Step reward of node s at depth t (0-based), over the trajectories m(s)
    through it: `v_k = γ^{T_k − 1 − t} R_out(τ_k) + R_fm(s)`, `R_fm = b (2x − 1)`
    with x the format score (SPEC §6.4) and `b = fmt_bound`.

    * `rule="portool"`: `R(s) = max_k v_k`; at every fork whose children all
      got the same value (max − min ≤ 1e-6) each child's reward becomes
      `mean_k v_k`. `"max"`: `max_k v_k`. `"avg"`: `mean_k v_k`. `"mix2"`:
      `G({γ^{T_k−1−t} R_out}) + R_fm(s)` with the tie rule on the outcome part.
    * `A_trj(τ_k)`: z-score of `R_out` over the query's trajectories.
    * `A_fork(s)`: z-score of `R(s)` over its siblings (the distinct children of
      its parent; the root is the parent of the first steps); 0 without one.
    * `A = w1 · mean_{k∈m(s)} A_trj(τ_k) + w2 · A_fork(s)`, `w1 = 1`,
      `w2 = n |τ_j| / (|m(s)| · |s| · |C(parent(s))| · N_forks)` (Theorem 3.1;
      `|τ_j|`, `|s|` policy-token counts, N_forks the number of nodes with
      more than one distinct child, root included); w2 = 0 where A_fork = 0.
      `weighting`: `"theorem"`, `"traj_only"` (w2 = 0), `"fork_only"` (w1 = 0),
      `"no_scale"` (w1 = w2 = 1).

    Reading (SPEC §6.2): the paper's "G = max if sibling rewards differ, avg
    otherwise" is circular as written; the tie rule above matches its stated
    purpose (averaging breaks ties between equally optimal siblings). It is
    applied at forks only (a parent with at least two distinct children).
    Shared nodes read `fmt_score` and `step_tokens` from the lowest-index
    trajectory through them. A trajectory with no valid step is padding: n
    counts the others.

    Args:
      node_id: `[N, n, S]` int node ids, unique within a query, shared by the
        trajectories through the same node; −1 on padding.
      step_mask: `[N, n, S]` bool valid steps (a prefix).
      outcome: `[N, n]` `R_out` ∈ {+1, −1, 0}.
      fmt_score: `[N, n, S]` raw format scores x ∈ [0, 1].
      step_tokens: `[N, n, S]` policy-token count of each step.
      gamma: discount γ.
      fmt_bound: b, the format reward lies in [−b, b].
      rule: `"portool"`, `"max"`, `"avg"` or `"mix2"`.
      weighting: `"theorem"`, `"traj_only"`, `"fork_only"` or `"no_scale"`.
      scale, ddof, eps: group normalisation (SPEC §1) of A_trj and A_fork.

    Returns:
      A `TreeCredit`.
    """
    check_choice("rule", rule, RULES)
    check_choice("weighting", weighting, WEIGHTINGS)
    dtype = float_dtype(outcome, fmt_score)
    node_id = jnp.asarray(node_id, jnp.int32)
    step_mask = jnp.asarray(step_mask, bool)
    outcome = jnp.asarray(outcome, dtype)
    fmt_score = jnp.asarray(fmt_score, dtype)
    step_tokens = jnp.asarray(step_tokens, jnp.int32)
    chex.assert_rank([node_id, step_mask, outcome, fmt_score, step_tokens], [3, 3, 2, 3, 3])
    chex.assert_equal_shape([node_id, step_mask, fmt_score, step_tokens])
    chex.assert_equal_shape_prefix([node_id, outcome], 2)
    per_query = jax.vmap(
        lambda *args: _query_tree_credit(
            *args, gamma=gamma, fmt_bound=fmt_bound, rule=rule, weighting=weighting,
            scale=scale, ddof=ddof, eps=eps,
        )
    )
    return per_query(node_id, step_mask, outcome, fmt_score, step_tokens)
