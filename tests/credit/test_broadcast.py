"""Per-trajectory / turn / step values to tokens and back (SPEC §1).

Hand-computed layouts with environment tokens between turns, plus the
property that every output is exactly 0 off the policy tokens.
"""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentrl.credit import (
    first_step_of_turns,
    last_token_positions,
    step_token_counts,
    trajectory_to_tokens,
    turn_steps_to_tokens,
    units_to_tokens,
)

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)

# Row 0: turn 0 = steps 0 (2 tokens) and 1 (1 token), turn 1 = step 2 (2 tokens);
#        a tool result between steps 0 and 1, a user message between the turns.
# Row 1: turn 0 = step 0, turn 1 = steps 1, 2, 3 (the third is outside S = 2).
TURN_ID = np.array(
    [
        [0, 0, -1, 0, -1, 1, 1, -1],
        [0, -1, 1, 1, -1, 1, -1, 1],
    ],
    np.int32,
)
STEP_ID = np.array(
    [
        [0, 0, -1, 1, -1, 2, 2, -1],
        [0, -1, 1, 1, -1, 2, -1, 3],
    ],
    np.int32,
)
LOSS_MASK = TURN_ID >= 0


def _jit_or_not(fn, jit, **static):
    fn = functools.partial(fn, **static)
    return jax.jit(fn) if jit else fn


JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@JIT
def test_trajectory_to_tokens_hand_case(jit):
    mask = np.array([[1, 0, 1], [0, 1, 1], [0, 0, 0]], bool)
    out = _jit_or_not(trajectory_to_tokens, jit)(np.array([2.0, -1.5, 9.0]), mask)
    np.testing.assert_array_equal(
        np.asarray(out), [[2.0, 0.0, 2.0], [0.0, -1.5, -1.5], [0.0, 0.0, 0.0]]
    )


@JIT
def test_units_to_tokens_hand_case(jit):
    per_unit = np.array([[10.0, 20.0, 30.0], [1.0, 2.0, 3.0]], np.float32)
    unit_id = np.array([[0, 2, -1, 3, 1], [1, 1, 5, 0, 2]], np.int32)
    mask = np.array([[1, 1, 1, 1, 0], [1, 0, 1, 1, 1]], bool)
    out = _jit_or_not(units_to_tokens, jit)(per_unit, unit_id, mask)
    # -1 and 3 (row 0), 5 (row 1) are out of range; masked tokens give 0 too.
    np.testing.assert_array_equal(
        np.asarray(out), [[10.0, 30.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 1.0, 3.0]]
    )


@JIT
def test_turn_steps_to_tokens_hand_case(jit):
    per_turn_step = np.array(
        [
            [[1.0, 2.0], [3.0, 4.0]],
            [[5.0, 6.0], [7.0, 8.0]],
        ],
        np.float32,
    )
    out = _jit_or_not(turn_steps_to_tokens, jit)(per_turn_step, TURN_ID, STEP_ID, LOSS_MASK)
    # Row 0: (t0,s0) (t0,s0) env (t0,s1) env (t1,s0) (t1,s0) env.
    # Row 1: (t0,s0) env (t1,s0) (t1,s0) env (t1,s1) env (t1,s2 → outside S = 2).
    np.testing.assert_array_equal(
        np.asarray(out),
        [
            [1.0, 1.0, 0.0, 2.0, 0.0, 3.0, 3.0, 0.0],
            [5.0, 0.0, 7.0, 7.0, 0.0, 8.0, 0.0, 0.0],
        ],
    )


@JIT
def test_first_step_of_turns_hand_case(jit):
    fn = _jit_or_not(first_step_of_turns, jit, num_turns=3)
    first = fn(TURN_ID, STEP_ID, LOSS_MASK)
    # Turn 2 has no policy token: 0.
    np.testing.assert_array_equal(np.asarray(first), [[0, 2, 0], [0, 1, 0]])


@JIT
def test_step_token_counts_hand_case(jit):
    counts = _jit_or_not(step_token_counts, jit, num_steps=4)(STEP_ID, LOSS_MASK)
    np.testing.assert_array_equal(np.asarray(counts), [[2, 1, 2, 0], [1, 2, 1, 1]])
    # Masked tokens are not counted even with a valid id; ids ≥ num_steps are dropped.
    step_id = np.array([[0, 0, 1, 1, 5, 2]], np.int32)
    mask = np.array([[1, 0, 1, 1, 1, 1]], bool)
    counts = _jit_or_not(step_token_counts, jit, num_steps=3)(step_id, mask)
    np.testing.assert_array_equal(np.asarray(counts), [[1, 2, 1]])


@JIT
def test_last_token_positions_hand_case(jit):
    last = _jit_or_not(last_token_positions, jit, num_units=3)(TURN_ID, LOSS_MASK)
    np.testing.assert_array_equal(np.asarray(last), [[3, 6, -1], [0, 7, -1]])
    last_step = _jit_or_not(last_token_positions, jit, num_units=4)(STEP_ID, LOSS_MASK)
    np.testing.assert_array_equal(np.asarray(last_step), [[1, 3, 6, -1], [0, 3, 5, 7]])
    # A policy token whose unit is masked out does not count.
    mask = LOSS_MASK.copy()
    mask[0, 6] = False
    last = _jit_or_not(last_token_positions, jit, num_units=3)(TURN_ID, mask)
    np.testing.assert_array_equal(np.asarray(last)[0], [3, 5, -1])


# ---------------------------------------------------------------- off-policy zeros

B, T, K, L, S = 3, 10, 4, 3, 3


@st.composite
def token_layouts(draw):
    """Global step ids increasing along each row, turns grouping consecutive steps."""
    mask = draw(hnp.arrays(bool, (B, T)))
    new_step = draw(hnp.arrays(bool, (B, T)))
    new_turn = draw(hnp.arrays(bool, (B, T))) & new_step
    step_id = np.where(mask, np.cumsum(new_step & mask, axis=1) - 1, -1)
    turn_id = np.where(mask, np.cumsum(new_turn & mask, axis=1) - 1, -1)
    # The first policy token of a row starts step 0 and turn 0.
    step_id = np.where(mask, np.maximum(step_id, 0), -1)
    turn_id = np.where(mask, np.maximum(turn_id, 0), -1)
    return mask, step_id.astype(np.int32), turn_id.astype(np.int32)


VALUES = st.floats(-10.0, 10.0, width=32).filter(lambda x: x != 0.0)

_trajectory = jax.jit(trajectory_to_tokens)
_units = jax.jit(units_to_tokens)
_turn_steps = jax.jit(turn_steps_to_tokens)


@PROPERTY_SETTINGS
@given(
    layout=token_layouts(),
    per_trajectory=hnp.arrays(np.float32, (B,), elements=VALUES),
    per_unit=hnp.arrays(np.float32, (B, K), elements=VALUES),
    per_turn_step=hnp.arrays(np.float32, (B, L, S), elements=VALUES),
    wild_ids=hnp.arrays(np.int32, (B, T), elements=st.integers(-2, K + 2)),
)
def test_outputs_are_zero_off_policy_tokens(
    layout, per_trajectory, per_unit, per_turn_step, wild_ids
):
    mask, step_id, turn_id = layout
    off = ~mask

    trajectory = np.asarray(_trajectory(per_trajectory, mask))
    assert np.all(trajectory[off] == 0.0)
    expected_trajectory = np.broadcast_to(per_trajectory[:, None], (B, T))
    np.testing.assert_array_equal(trajectory[mask], expected_trajectory[mask])

    # Unit ids anywhere (also on masked tokens, and out of range).
    units = np.asarray(_units(per_unit, wild_ids, mask))
    assert np.all(units[off] == 0.0)
    in_range = mask & (wild_ids >= 0) & (wild_ids < K)
    rows = np.broadcast_to(np.arange(B)[:, None], (B, T))
    np.testing.assert_array_equal(
        units[in_range], per_unit[rows[in_range], wild_ids[in_range]]
    )
    assert np.all(units[mask & ~in_range] == 0.0)

    placed = np.asarray(_turn_steps(per_turn_step, turn_id, step_id, mask))
    assert np.all(placed[off] == 0.0)
    # Reference: local step = global step − first global step of the token's turn.
    for b in range(B):
        for t in np.nonzero(mask[b])[0]:
            turn = turn_id[b, t]
            first = step_id[b][mask[b] & (turn_id[b] == turn)].min()
            local = step_id[b, t] - first
            expected = per_turn_step[b, turn, local] if turn < L and local < S else 0.0
            assert placed[b, t] == expected
