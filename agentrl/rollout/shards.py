"""Trajectory shards: versioned msgpack files written atomically (temp file + rename).

A shard holds a header (`format_version`, `policy_version`, creation time,
free-form metadata) and a list of `Trajectory` records. Readers refuse shards
of another format version with a message naming both versions. Writers never
leave a partial file under the final name: the bytes go to a temporary file in
the same directory, are fsynced, then renamed (atomic on POSIX).
"""

import dataclasses
import os
import pathlib
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import serialization

from agentrl.types import TRAJECTORY_FORMAT_VERSION, Trajectory

SHARD_SUFFIX = ".trajectories.msgpack"
_ARRAY_FIELDS = tuple(
    f.name for f in dataclasses.fields(Trajectory)
    if f.name not in ("prompt_id", "outcome", "reference_turns", "policy_version",
                      "episode_steps", "metadata")
)


def _to_plain(value: Any) -> Any:
    """Metadata as msgpack-safe builtins (tuples → lists, numpy scalars → Python)."""
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def trajectory_to_record(trajectory: Trajectory) -> dict[str, Any]:
    record = {name: getattr(trajectory, name) for name in _ARRAY_FIELDS
              if getattr(trajectory, name) is not None}
    record.update(
        prompt_id=trajectory.prompt_id,
        outcome=float(trajectory.outcome),
        reference_turns=trajectory.reference_turns,
        policy_version=int(trajectory.policy_version),
        episode_steps=trajectory.episode_steps,
        metadata=_to_plain(trajectory.metadata),
    )
    return record


def record_to_trajectory(record: dict[str, Any]) -> Trajectory:
    record = dict(record)
    return Trajectory(**{k: v for k, v in record.items()})


def write_shard(path: str | os.PathLike, trajectories: Sequence[Trajectory], *,
                policy_version: int = 0, metadata: dict[str, Any] | None = None) -> pathlib.Path:
    """Writes a shard atomically; returns its path (suffix `.trajectories.msgpack` added)."""
    path = pathlib.Path(path)
    if not path.name.endswith(SHARD_SUFFIX):
        path = path.with_name(path.name + SHARD_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "header": {
            "format_version": TRAJECTORY_FORMAT_VERSION,
            "policy_version": int(policy_version),
            "created": time.time(),
            "count": len(trajectories),
            "metadata": _to_plain(metadata or {}),
        },
        "trajectories": [trajectory_to_record(t) for t in trajectories],
    }
    data = serialization.msgpack_serialize(payload)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        pathlib.Path(temp).unlink(missing_ok=True)
        raise
    return path


def read_shard(path: str | os.PathLike) -> tuple[dict[str, Any], list[Trajectory]]:
    """`(header, trajectories)` of a shard; refuses other format versions."""
    path = pathlib.Path(path)
    payload = serialization.msgpack_restore(path.read_bytes())
    header = payload["header"]
    version = header.get("format_version")
    if version != TRAJECTORY_FORMAT_VERSION:
        raise ValueError(
            f"trajectory shard {path} has format_version={version!r}, but this agentrl reads "
            f"version {TRAJECTORY_FORMAT_VERSION}; regenerate it or use the matching agentrl."
        )
    records = payload["trajectories"]
    if isinstance(records, dict):  # msgpack_restore turns lists of dicts into index dicts
        records = [records[k] for k in sorted(records, key=int)]
    return header, [record_to_trajectory(r) for r in records]


def list_shards(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Finished shards of a directory (temporary files excluded), oldest first."""
    directory = pathlib.Path(directory)
    shards = [p for p in directory.glob(f"*{SHARD_SUFFIX}") if not p.name.startswith(".")]
    return sorted(shards, key=lambda p: (p.stat().st_mtime, p.name))
