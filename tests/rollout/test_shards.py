"""Trajectory shards: round trip, format version, atomic writes."""

import os

import numpy as np
import pytest

from agentrl.rollout import shards
from agentrl.types import Trajectory


def make(prompt_id="q", outcome=1.0):
    return Trajectory(
        prompt_id, [1, 2, 3, 4], [0, 1, 1, 0], [-1, 0, 0, -1], [-1, 0, 0, -1],
        rollout_logprobs=np.array([0, -0.5, -0.1, 0], np.float32), outcome=outcome,
        node_id=np.array([7]), fmt_score=np.array([0.8], np.float32), policy_version=3,
        episode_steps=2,
        checklist_sat_after=np.ones((1, 1, 2), bool),
        metadata={"finish": "answer", "boundaries": [(0, 1)], "messages": [{"role": "user"}]},
    )


def test_round_trip_keeps_every_field(tmp_path):
    path = shards.write_shard(tmp_path / "step_3", [make("a"), make("b", -1.0)],
                              policy_version=3, metadata={"worker": 1})
    assert path.name.endswith(shards.SHARD_SUFFIX)
    header, trajectories = shards.read_shard(path)
    assert header["count"] == 2 and header["policy_version"] == 3
    assert header["metadata"] == {"worker": 1}
    a, b = trajectories
    original = make("a")
    for field in ("tokens", "loss_mask", "step_id", "turn_id", "rollout_logprobs", "node_id",
                  "fmt_score", "checklist_sat_after"):
        np.testing.assert_array_equal(getattr(a, field), getattr(original, field))
        assert getattr(a, field).dtype == getattr(original, field).dtype
    assert b.outcome == -1.0 and a.episode_steps == 2 and a.policy_version == 3
    assert a.metadata["boundaries"] == [[0, 1]] and a.metadata["finish"] == "answer"
    assert a.turn_rewards is None


def test_other_format_versions_are_refused(tmp_path, monkeypatch):
    path = shards.write_shard(tmp_path / "old", [make()])
    monkeypatch.setattr(shards, "TRAJECTORY_FORMAT_VERSION", 99)
    with pytest.raises(ValueError, match=r"format_version=1.*reads version 99"):
        shards.read_shard(path)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        shards.write_shard(tmp_path / "s", [make()])
    assert list(tmp_path.iterdir()) == []
    assert shards.list_shards(tmp_path) == []


def test_list_shards_skips_temporary_files(tmp_path):
    shards.write_shard(tmp_path / "a", [make()])
    (tmp_path / ".b.trajectories.msgpack.123.tmp").write_bytes(b"partial")
    assert [p.name for p in shards.list_shards(tmp_path)] == ["a" + shards.SHARD_SUFFIX]
