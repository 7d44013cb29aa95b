"""Per-trajectory / per-turn / per-step quantities to and from tokens (SPEC §1).

Every policy token carries `turn_id[b, t]` and `step_id[b, t]` (0-based within
the trajectory, −1 on non-policy tokens). Credit functions produce advantages
per trajectory `[B]`, per turn `[B, K]`, per step or segment `[B, S]`, or per
(turn, step-within-turn) `[B, L, S]` (CM2); these helpers place them on the
policy tokens. Every output is exactly 0 off the policy tokens.
"""

import chex
import jax.numpy as jnp

from agentrl.numerics import float_dtype


def _token_inputs(unit_id, loss_mask):
    unit_id = jnp.asarray(unit_id, jnp.int32)
    loss_mask = jnp.asarray(loss_mask, bool)
    chex.assert_rank([unit_id, loss_mask], 2)
    chex.assert_equal_shape([unit_id, loss_mask])
    return unit_id, loss_mask


def trajectory_to_tokens(per_trajectory: chex.Array, loss_mask: chex.Array) -> chex.Array:
    """Broadcasts `[B]` values to every policy token.

    Args:
      per_trajectory: `[B]`.
      loss_mask: `[B, T]` bool policy-token mask.

    Returns:
      `[B, T]`, 0 off the policy tokens.
    """
    per_trajectory = jnp.asarray(per_trajectory, float_dtype(per_trajectory))
    loss_mask = jnp.asarray(loss_mask, bool)
    chex.assert_rank([per_trajectory, loss_mask], [1, 2])
    chex.assert_equal_shape_prefix([per_trajectory, loss_mask], 1)
    return jnp.where(loss_mask, per_trajectory[:, None], 0.0)


def units_to_tokens(
    per_unit: chex.Array, unit_id: chex.Array, loss_mask: chex.Array
) -> chex.Array:
    """Gathers per-unit values (turns, steps, segments) onto tokens.

    `out[b, t] = per_unit[b, unit_id[b, t]]` on policy tokens with a valid id.

    Args:
      per_unit: `[B, K]`.
      unit_id: `[B, T]` int unit of each token (−1 off-policy).
      loss_mask: `[B, T]` bool.

    Returns:
      `[B, T]`, 0 off the policy tokens and where `unit_id` is outside [0, K).
    """
    per_unit = jnp.asarray(per_unit, float_dtype(per_unit))
    unit_id, loss_mask = _token_inputs(unit_id, loss_mask)
    chex.assert_rank(per_unit, 2)
    chex.assert_equal_shape_prefix([per_unit, unit_id], 1)
    num_units = per_unit.shape[1]
    valid = loss_mask & (unit_id >= 0) & (unit_id < num_units)
    gathered = jnp.take_along_axis(per_unit, jnp.clip(unit_id, 0, num_units - 1), axis=1)
    return jnp.where(valid, gathered, 0.0)


turns_to_tokens = units_to_tokens
steps_to_tokens = units_to_tokens


def first_step_of_turns(
    turn_id: chex.Array, step_id: chex.Array, loss_mask: chex.Array, num_turns: int
) -> chex.Array:
    """The global `step_id` of each turn's first step.

    Args:
      turn_id: `[B, T]` int.
      step_id: `[B, T]` int, global step index (0-based in the trajectory).
      loss_mask: `[B, T]` bool.
      num_turns: L, static.

    Returns:
      `[B, L]` int, 0 for turns with no policy token.
    """
    turn_id, loss_mask = _token_inputs(turn_id, loss_mask)
    step_id = jnp.asarray(step_id, jnp.int32)
    chex.assert_equal_shape([turn_id, step_id])
    batch, length = turn_id.shape
    valid = loss_mask & (turn_id >= 0) & (turn_id < num_turns)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    big = jnp.iinfo(jnp.int32).max
    first = jnp.full((batch, num_turns), big, jnp.int32).at[
        rows, jnp.where(valid, turn_id, num_turns)
    ].min(step_id, mode="drop")
    return jnp.where(first == big, 0, first)


def turn_steps_to_tokens(
    per_turn_step: chex.Array,
    turn_id: chex.Array,
    step_id: chex.Array,
    loss_mask: chex.Array,
) -> chex.Array:
    """Places per-(turn, step-within-turn) values on tokens (CM2 step level).

    The step-within-turn index of a token is its global `step_id` minus the
    global id of its turn's first step.

    Args:
      per_turn_step: `[B, L, S]`.
      turn_id: `[B, T]` int.
      step_id: `[B, T]` int, global step index.
      loss_mask: `[B, T]` bool.

    Returns:
      `[B, T]`, 0 off the policy tokens and outside the `[L, S]` grid.
    """
    per_turn_step = jnp.asarray(per_turn_step, float_dtype(per_turn_step))
    turn_id, loss_mask = _token_inputs(turn_id, loss_mask)
    step_id = jnp.asarray(step_id, jnp.int32)
    chex.assert_rank(per_turn_step, 3)
    batch, num_turns, num_steps = per_turn_step.shape
    first = first_step_of_turns(turn_id, step_id, loss_mask, num_turns)
    local_step = step_id - jnp.take_along_axis(first, jnp.clip(turn_id, 0, num_turns - 1), axis=1)
    in_grid = (turn_id >= 0) & (turn_id < num_turns) & (local_step >= 0) & (local_step < num_steps)
    flat_id = jnp.where(in_grid, turn_id * num_steps + local_step, -1)
    flat = per_turn_step.reshape(batch, num_turns * num_steps)
    return units_to_tokens(flat, flat_id, loss_mask)


def step_token_counts(step_id: chex.Array, loss_mask: chex.Array, num_steps: int) -> chex.Array:
    """Number of policy tokens of each step, `|s|` (PORTool Theorem 3.1).

    Args:
      step_id: `[B, T]` int.
      loss_mask: `[B, T]` bool.
      num_steps: S, static.

    Returns:
      `[B, S]` int32 counts.
    """
    step_id, loss_mask = _token_inputs(step_id, loss_mask)
    batch, length = step_id.shape
    valid = loss_mask & (step_id >= 0) & (step_id < num_steps)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    return jnp.zeros((batch, num_steps), jnp.int32).at[
        rows, jnp.where(valid, step_id, num_steps)
    ].add(1, mode="drop")


def last_token_positions(unit_id: chex.Array, loss_mask: chex.Array, num_units: int) -> chex.Array:
    """Position of the last policy token of each unit (turn, step, segment).

    Args:
      unit_id: `[B, T]` int unit of each token (−1 off-policy).
      loss_mask: `[B, T]` bool.
      num_units: K, static.

    Returns:
      `[B, K]` int32 positions, −1 for units with no policy token.
    """
    unit_id, loss_mask = _token_inputs(unit_id, loss_mask)
    batch, length = unit_id.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    valid = loss_mask & (unit_id >= 0) & (unit_id < num_units)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    return jnp.full((batch, num_units), -1, jnp.int32).at[
        rows, jnp.where(valid, unit_id, num_units)
    ].max(positions, mode="drop")
