"""Trajectory validation and collate padding (agentrl.types)."""

import jax
import numpy as np
import pytest

from agentrl.types import Batch, Trajectory, collate, to_device


def make(prompt_id="q", policy=(2, 3), outcome=1.0, **extra):
    tokens, loss_mask, step_id, turn_id = [1, 2], [0, 0], [-1, -1], [-1, -1]
    for step, count in enumerate(policy):
        tokens += [5] * count + [9]
        loss_mask += [1] * count + [0]
        step_id += [step] * count + [-1]
        turn_id += [0] * count + [-1]
    return Trajectory(prompt_id, tokens, loss_mask, step_id, turn_id, outcome=outcome, **extra)


def test_trajectory_rejects_inconsistent_arrays_with_a_clear_message():
    with pytest.raises(ValueError, match="step_id has shape"):
        Trajectory("q", [1, 2, 3], [0, 1, 1], [-1, 0], [-1, 0, 0])
    with pytest.raises(ValueError, match="must be -1 on tokens with loss_mask 0"):
        Trajectory("q", [1, 2], [0, 1], [0, 0], [-1, 0])
    with pytest.raises(ValueError, match="needs step_id >= 0"):
        Trajectory("q", [1, 2], [0, 1], [-1, -1], [-1, 0])


def test_trajectory_counts_steps_and_turns():
    trajectory = make(policy=(2, 3, 1))
    assert trajectory.num_steps == 3
    assert trajectory.num_turns == 1


def test_collate_pads_every_field():
    trajectories = [make("a", (2,), 1.0, node_id=[7]), make("a", (1, 4), 0.0, node_id=[7, 8])]
    batch = collate(trajectories, group_size=2, max_length=16)
    assert isinstance(batch, Batch)
    assert batch.tokens.shape == (2, 16)
    assert batch.group_size == 2 and batch.num_groups == 1
    np.testing.assert_array_equal(batch.step_mask, [[True, False], [True, True]])
    np.testing.assert_array_equal(batch.node_id, [[7, -1], [7, 8]])
    np.testing.assert_array_equal(batch.step_id[0], [-1, -1, 0, 0, -1] + [-1] * 11)
    np.testing.assert_array_equal(batch.loss_mask[1].sum(), 5)
    np.testing.assert_array_equal(batch.outcome, [1.0, 0.0])
    assert batch.values is None and batch.checklist_sat_after is None
    device_batch = to_device(batch)
    assert isinstance(device_batch.tokens, jax.Array)
    # Batch is a pytree with group_size static: it passes through jit.
    doubled = jax.jit(lambda b: b.replace(outcome=2 * b.outcome))(device_batch)
    np.testing.assert_array_equal(np.asarray(doubled.outcome), [2.0, 0.0])
    assert doubled.group_size == 2


def test_collate_rejects_bad_groups():
    with pytest.raises(ValueError, match="group_size=3"):
        collate([make("a"), make("a")], group_size=3)
    with pytest.raises(ValueError, match="mix prompts"):
        collate([make("a"), make("b")], group_size=2)
    with pytest.raises(ValueError, match="no trajectories"):
        collate([], group_size=1)
    with pytest.raises(ValueError, match="does not fit"):
        collate([make("a", (5,))], group_size=1, max_length=4)


def test_collate_keeps_reference_turns_only_when_every_trajectory_has_one():
    checklist = dict(checklist_sat_after=np.zeros((1, 2, 1), bool))
    complete = collate([make("a", reference_turns=2, **checklist),
                        make("a", reference_turns=2, **checklist)], group_size=2)
    np.testing.assert_array_equal(complete.reference_turns, [2.0, 2.0])
    partial = collate([make("a", reference_turns=2, **checklist), make("a", **checklist)],
                      group_size=2)
    assert partial.reference_turns is None
