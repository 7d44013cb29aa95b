"""Trajectory shards → fixed-shape batches: exactly-once reading, state round trips, staleness."""

import json
import threading
import time

import jax
import numpy as np
import pytest

from agentrl.data import (
    TrajectoryBatcher,
    TrajectoryShardDataset,
    TrajectoryShardReader,
    batches,
)
from agentrl.rollout.shards import write_shard
from agentrl.types import Trajectory

SHAPE = dict(max_length=16, max_steps=4, max_turns=3)


def _trajectory(prompt_id, length, steps=1, outcome=0.0, **fields):
    prompt = max(1, length - 2 * steps)
    loss_mask = np.zeros(length, bool)
    step_id = np.full(length, -1)
    turn_id = np.full(length, -1)
    for s in range(steps):
        position = min(prompt + 2 * s, length - 1)
        loss_mask[position] = True
        step_id[position] = s
        turn_id[position] = 0
    return Trajectory(prompt_id=prompt_id, tokens=np.arange(length) % 7, loss_mask=loss_mask,
                      step_id=step_id, turn_id=turn_id, outcome=outcome,
                      rollout_logprobs=-np.ones(length, np.float32), **fields)


def _group(prompt_id, group_size, seed):
    rng = np.random.RandomState(seed)
    return [_trajectory(prompt_id, int(rng.randint(4, 16)), int(rng.randint(1, 4)),
                        outcome=float(rng.rand())) for _ in range(group_size)]


def _write(directory, index, *, groups=2, group_size=2, version=0):
    trajectories = []
    for g in range(groups):
        trajectories += _group(f"s{index}-p{g}", group_size, seed=100 * index + g)
    return write_shard(directory / f"shard-{index:04d}", trajectories, policy_version=version)


def _reader(directory, *, version=0, max_staleness=None, **options):
    return TrajectoryShardReader(directory, max_staleness=max_staleness,
                                 current_version_fn=lambda: version, follow=False, **options)


def _names(shards):
    return [shard.name for shard in shards]


def _key(trajectory):
    return (trajectory.prompt_id, trajectory.tokens.tobytes(), trajectory.outcome)


# ---------------------------------------------------------------------------
# Reader.
# ---------------------------------------------------------------------------


def test_reader_yields_each_shard_once_in_order(tmp_path):
    paths = [_write(tmp_path, i) for i in range(4)]
    reader = _reader(tmp_path)
    shards = list(reader)
    assert _names(shards) == [p.name for p in paths]
    assert [len(s.trajectories) for s in shards] == [4] * 4
    assert shards[2].trajectories[0].prompt_id == "s2-p0"
    assert list(reader) == []  # nothing new
    _write(tmp_path, 9)
    assert _names(reader) == ["shard-0009.trajectories.msgpack"]


def test_reader_restored_mid_way_yields_the_rest_exactly_once(tmp_path):
    for i in range(5):
        _write(tmp_path, i)
    reader = _reader(tmp_path)
    first = [next(reader), next(reader)]
    state = json.loads(json.dumps(reader.get_state()))
    del reader  # "killed"
    for i in range(5, 8):  # written while the trainer was down
        _write(tmp_path, i)
    resumed = _reader(tmp_path)
    resumed.set_state(state)
    rest = list(resumed)
    seen = _names(first) + _names(rest)
    assert sorted(seen) == sorted(f"shard-{i:04d}.trajectories.msgpack" for i in range(8))
    assert len(seen) == len(set(seen)) == 8
    assert _names(rest)[:3] == [f"shard-{i:04d}.trajectories.msgpack" for i in (2, 3, 4)]
    with pytest.raises(ValueError, match="get_state"):
        resumed.set_state({"consumed": []})


def test_staleness_drops_and_counts_old_shards(tmp_path):
    for i, version in enumerate([0, 1, 2, 3, 4]):
        _write(tmp_path, i, version=version)
    reader = _reader(tmp_path, version=4, max_staleness=1)
    kept = list(reader)
    assert [s.policy_version for s in kept] == [3, 4]
    assert reader.dropped_stale == 3
    assert len(reader.consumed) == 5  # dropped shards are never looked at again
    restored = _reader(tmp_path, version=4, max_staleness=1)
    restored.set_state(reader.get_state())
    assert list(restored) == [] and restored.dropped_stale == 3
    assert [s.policy_version for s in _reader(tmp_path, version=4)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_staleness"):
        _reader(tmp_path, max_staleness=-1)


def test_following_reader_waits_for_a_new_shard_then_times_out(tmp_path):
    reader = TrajectoryShardReader(tmp_path / "later", max_staleness=None,
                                   current_version_fn=lambda: 0, poll_interval_s=0.02,
                                   timeout_s=2.0)
    writer = threading.Timer(0.2, lambda: _write(tmp_path / "later", 0))
    writer.start()
    start = time.monotonic()
    shard = next(reader)
    assert shard.name == "shard-0000.trajectories.msgpack"
    assert time.monotonic() - start >= 0.15
    writer.join()
    reader.timeout_s = 0.1
    with pytest.raises(TimeoutError, match=r"no fresh shard .* rollout workers"):
        next(reader)


def test_shard_dataset_is_a_grain_pipeline(tmp_path):
    for i in range(3):
        _write(tmp_path, i, groups=i + 1)
    dataset = TrajectoryShardDataset(tmp_path, max_staleness=None,
                                     current_version_fn=lambda: 0, follow=False)
    counts = list(dataset.map(lambda shard: len(shard.trajectories)))
    assert counts == [2, 4, 6]
    assert isinstance(iter(dataset), TrajectoryShardReader)


# ---------------------------------------------------------------------------
# Fixed-shape batches.
# ---------------------------------------------------------------------------


def _shapes(batch):
    return jax.tree_util.tree_map(np.shape, batch)


def test_batches_pad_rows_and_lengths_to_a_fixed_shape():
    small = batches(_group("a", 2, 0), group_size=2, rows=6, **SHAPE)
    large = batches(_group("a", 2, 1) + _group("b", 2, 2) + _group("c", 2, 3), group_size=2,
                    rows=6, **SHAPE)
    assert _shapes(small) == _shapes(large)
    assert small.tokens.shape == (6, 16) and small.step_mask.shape == (6, 4)
    assert small.turn_mask.shape == (6, 3)
    np.testing.assert_array_equal(small.row_mask, [True, True, False, False, False, False])
    assert not small.loss_mask[2:].any() and not small.step_mask[2:].any()
    assert (small.step_id[2:] == -1).all() and (small.turn_id[2:] == -1).all()
    assert (small.outcome[2:] == 0).all() and small.group_size == 2
    assert large.row_mask.all()


def test_batches_errors_name_the_trajectory_and_the_option():
    long = [_trajectory("too-long", 20), _trajectory("too-long", 4)]
    with pytest.raises(ValueError, match=r"'too-long': tokens = 20 exceeds max_length=16"):
        batches(long, group_size=2, rows=2, **SHAPE)
    many_steps = [_trajectory("p", 16, steps=6), _trajectory("p", 4)]
    with pytest.raises(ValueError, match="steps = 6 exceeds max_steps=4"):
        batches(many_steps, group_size=2, rows=2, **SHAPE)
    with pytest.raises(ValueError, match="rows=5 must be a positive multiple of group_size=2"):
        batches(_group("a", 2, 0), group_size=2, rows=5, **SHAPE)
    with pytest.raises(ValueError, match="do not fit rows=2"):
        batches(_group("a", 2, 0) + _group("b", 2, 0), group_size=2, rows=2, **SHAPE)


def test_batches_fix_checklist_shapes():
    def with_checklist(prompt_id, turns, items):
        return _trajectory(prompt_id, 8, steps=1,
                           checklist_sat_after=np.ones((turns, 1, items), bool),
                           checklist_deps=np.zeros((turns, items, items), bool),
                           checklist_weights=np.ones((turns, items), np.float32),
                           checklist_item_mask=np.ones((turns, items), bool),
                           checklist_step_mask=np.ones((turns, 1), bool))

    a = batches([with_checklist("a", 1, 2)] * 2, group_size=2, rows=4, checklist_shape=(3, 2, 4),
                **SHAPE)
    b = batches([with_checklist("b", 3, 4)] * 2, group_size=2, rows=4, checklist_shape=(3, 2, 4),
                **SHAPE)
    assert _shapes(a) == _shapes(b)
    assert a.checklist_sat_after.shape == (4, 3, 2, 4) and a.checklist_deps.shape == (4, 3, 4, 4)
    assert a.checklist_item_mask[0].sum() == 2 and not a.checklist_item_mask[2:].any()
    with pytest.raises(ValueError,
                       match=r"checklist_sat_after size C = 5 exceeds checklist_shape\[2\]=4"):
        batches([with_checklist("c", 1, 5)] * 2, group_size=2, rows=2,
                checklist_shape=(3, 2, 4), **SHAPE)


# ---------------------------------------------------------------------------
# Batcher.
# ---------------------------------------------------------------------------


def _batcher(directory, **reader_options):
    return TrajectoryBatcher(_reader(directory, **reader_options), group_size=2, rows=6, **SHAPE)


def test_batcher_fills_whole_groups_and_pads_the_last_batch(tmp_path):
    for i in range(4):  # 4 shards × 2 groups × 2 = 16 trajectories = 8 groups
        _write(tmp_path, i, version=i)
    items = list(_batcher(tmp_path))
    assert [int(item.batch.row_mask.sum()) for item in items] == [6, 6, 4]
    assert len({str(_shapes(item.batch)) for item in items}) == 1
    for item in items:
        ids = [t.prompt_id for t in item.trajectories]
        assert all(ids[i] == ids[i + 1] for i in range(0, len(ids), 2))  # groups intact
    np.testing.assert_array_equal(items[0].policy_versions, [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(items[2].policy_versions, [3, 3, 3, 3, -1, -1])
    assert items[0].shards == ["shard-0000.trajectories.msgpack",
                               "shard-0001.trajectories.msgpack"]
    np.testing.assert_allclose(items[1].batch.outcome[:6],
                               [t.outcome for t in items[1].trajectories])


def test_batcher_restored_mid_shard_loses_and_repeats_nothing(tmp_path):
    for i in range(3):
        _write(tmp_path, i)
    reference_dir = tmp_path / "reference"
    for i in range(3):
        _write(reference_dir, i)
    for i in range(3, 5):
        _write(reference_dir, i)
    reference = [_key(t) for item in _batcher(reference_dir) for t in item.trajectories]

    batcher = _batcher(tmp_path)
    first = next(batcher)  # takes shard 0 and half of shard 1
    state = json.loads(json.dumps(batcher.get_state()))
    assert state["held"] == [["shard-0001.trajectories.msgpack", 2]]
    del batcher
    for i in range(3, 5):  # written while stopped
        _write(tmp_path, i)
    resumed = _batcher(tmp_path)
    resumed.set_state(state)
    rest = [t for item in resumed for t in item.trajectories]
    got = [_key(t) for t in first.trajectories + rest]
    assert got == reference
    assert len(got) == len(set(got)) == 20


def test_batcher_drops_held_remainder_that_became_stale(tmp_path):
    _write(tmp_path, 0, groups=4, version=0)
    version = {"now": 0}
    reader = TrajectoryShardReader(tmp_path, max_staleness=1, follow=False,
                                   current_version_fn=lambda: version["now"])
    batcher = TrajectoryBatcher(reader, group_size=2, rows=4, **SHAPE)
    assert int(next(batcher).batch.row_mask.sum()) == 4
    version["now"] = 2  # the held half of the shard is now older than the bound
    with pytest.raises(StopIteration):
        next(batcher)
    assert batcher.stats() == {"shards_consumed": 1, "shards_dropped_stale": 0,
                               "trajectories_dropped_stale": 4}


def test_batcher_rejects_shards_of_partial_groups(tmp_path):
    write_shard(tmp_path / "odd", [_trajectory("x", 5)] * 3)
    with pytest.raises(ValueError, match=r"odd\.trajectories\.msgpack holds 3 trajectories"):
        next(_batcher(tmp_path))
