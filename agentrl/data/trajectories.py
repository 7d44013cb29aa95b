"""Trajectory shards → fixed-shape padded batches (Grain iterators with checkpointable state).

The async trainer reads what rollout workers write under `workdir/trajectories/`
(`agentrl.rollout.shards`: atomic msgpack shards whose header carries the
`policy_version` that generated them):

    reader = TrajectoryShardReader(workdir / "trajectories", max_staleness=2,
                                   current_version_fn=lambda: int(state.step))
    batcher = TrajectoryBatcher(reader, group_size=8, rows=64, max_length=1024,
                                max_steps=8, max_turns=4)
    item = next(batcher)             # TrajectoryBatch(batch, trajectories, policy_versions, ...)
    data_state = batcher.get_state() # JSON; checkpoint it with the TrainState

Exactly once. The reader yields every finished shard of the directory once,
oldest first (modification time, then name), including shards that appear
later: with `follow=True` (default) `next()` waits for a new shard, polling
every `poll_interval_s`, and raises `TimeoutError` after `timeout_s`
(`None`: wait forever); with `follow=False` it stops when none is left. Its
state is the list of consumed shard names, so a reader restored from it skips
exactly those and yields the rest, shards written while the trainer was down
included. The batcher's state adds the shards it holds and how many
trajectories of each it has emitted, so a half-used shard resumes at the same
trajectory.

Staleness. A shard whose `policy_version < current_version - max_staleness` is
dropped, counted and marked consumed; the batcher applies the same rule again
to the remainder of a shard it held over from an earlier batch.

Fixed shapes. `batches()` pads to exactly `rows` rows (padding rows have
`row_mask=False`, `loss_mask=False`, ids −1) and to fixed `max_length`,
`max_steps`, `max_turns` (and `checklist_shape` for CM2 fields), so the jitted
update never recompiles. A trajectory too large for them is an error naming
it. Shards must hold whole groups: consecutive runs of `group_size`
trajectories sharing a `prompt_id`.
"""

import collections
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import grain
import numpy as np

from agentrl.rollout.shards import SHARD_SUFFIX, list_shards, read_shard
from agentrl.types import Batch, Trajectory, collate

READER_STATE_FORMAT = "agentrl-shard-reader-v1"
BATCHER_STATE_FORMAT = "agentrl-shard-batcher-v1"
_MINUS_ONE_FIELDS = frozenset({"step_id", "turn_id", "node_id"})
_CHECKLIST_FIELDS = {  # field: the checklist_shape (L, S_turn, C) axes of its trailing dims
    "checklist_sat_after": (0, 1, 2),
    "checklist_deps": (0, 2, 2),
    "checklist_weights": (0, 2),
    "checklist_item_mask": (0, 2),
    "checklist_step_mask": (0, 1),
}


# ---------------------------------------------------------------------------
# Fixed-shape padding.
# ---------------------------------------------------------------------------


def _check_fits(trajectory: Trajectory, max_length: int, max_steps: int, max_turns: int,
                checklist_shape: tuple[int, int, int] | None) -> None:
    checks = [("tokens", len(trajectory.tokens), max_length, "max_length"),
              ("steps", trajectory.num_steps, max_steps, "max_steps"),
              ("turns", trajectory.num_turns, max_turns, "max_turns")]
    for name in ("node_id", "fmt_score", "boundary_values"):
        value = getattr(trajectory, name)
        if value is not None:
            checks.append((f"len({name})", len(value), max_steps, "max_steps"))
    if trajectory.turn_rewards is not None:
        checks.append(("len(turn_rewards)", len(trajectory.turn_rewards), max_turns,
                       "max_turns"))
    if checklist_shape is not None:
        for name, axes in _CHECKLIST_FIELDS.items():
            value = getattr(trajectory, name)
            if value is None:
                continue
            for dim, axis in zip(np.shape(value), axes, strict=True):
                label = ("L", "S_turn", "C")[axis]
                checks.append((f"{name} size {label}", dim, checklist_shape[axis],
                               f"checklist_shape[{axis}]"))
    for what, have, limit, option in checks:
        if have > limit:
            raise ValueError(
                f"trajectory {trajectory.prompt_id!r}: {what} = {have} exceeds "
                f"{option}={limit}; raise {option} (or cap the rollout's context, steps and "
                "turns so trajectories fit).")


def _pad_to(array: np.ndarray, shape: tuple[int, ...], fill) -> np.ndarray:
    out = np.full(shape, fill, array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


def batches(
    trajectories: Sequence[Trajectory],
    *,
    group_size: int,
    max_length: int,
    max_steps: int,
    max_turns: int,
    rows: int,
    checklist_shape: tuple[int, int, int] | None = None,
) -> Batch:
    """Pads trajectories (whole groups, group by group) into a `Batch` of a fixed shape.

    Args:
      trajectories: `n × G` trajectories, `n × G <= rows`, consecutive runs of
        `group_size` sharing a prompt (`agentrl.types.collate`).
      group_size: G.
      max_length, max_steps, max_turns: padded T, S, K.
      rows: padded B (a multiple of `group_size`); rows past the
        trajectories have `row_mask=False` and empty masks.
      checklist_shape: padded `(L, S_turn, C)` of the CM2 checklist fields
        (None: the batch's own maxima, which vary from batch to batch).

    Returns:
      A numpy-backed `Batch` whose array shapes depend only on the arguments.
    """
    if group_size < 1 or rows < group_size or rows % group_size:
        raise ValueError(f"batches: rows={rows} must be a positive multiple of "
                         f"group_size={group_size} so padding keeps whole groups.")
    if not trajectories:
        raise ValueError("batches: got no trajectories; pass at least one group.")
    if len(trajectories) > rows:
        raise ValueError(f"batches: {len(trajectories)} trajectories do not fit rows={rows}; "
                         "pass at most `rows` (the batcher splits a stream into batches).")
    for trajectory in trajectories:
        _check_fits(trajectory, max_length, max_steps, max_turns, checklist_shape)
    batch = collate(trajectories, group_size=group_size, max_length=max_length,
                    max_steps=max_steps, max_turns=max_turns)
    fields = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if field.name == "group_size" or value is None:
            continue
        value = np.asarray(value)
        fill = -1 if field.name in _MINUS_ONE_FIELDS else 0
        if checklist_shape is not None and field.name in _CHECKLIST_FIELDS:
            trailing = tuple(checklist_shape[axis] for axis in _CHECKLIST_FIELDS[field.name])
            value = _pad_to(value, (value.shape[0], *trailing), fill)
        fields[field.name] = _pad_to(value, (rows, *value.shape[1:]), fill)
    return batch.replace(**fields)


# ---------------------------------------------------------------------------
# Shard reader.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrajectoryShard:
    """One shard as read: its file name, header, policy version and trajectories."""

    name: str
    policy_version: int
    header: dict[str, Any]
    trajectories: list[Trajectory]


class TrajectoryShardReader(grain.DatasetIterator):
    """Yields the fresh shards of a directory, each exactly once, oldest first.

    Args:
      directory: where rollout workers write shards (it may not exist yet).
      max_staleness: drop shards whose `policy_version` is older than
        `current_version_fn() - max_staleness` (None: keep everything).
      current_version_fn: the trainer's current policy version (its step).
      follow: wait for new shards (True) or stop when none is left (False).
      poll_interval_s: how often a waiting reader lists the directory.
      timeout_s: how long `next()` waits for a fresh shard before raising
        `TimeoutError` (None: forever; only with `follow=True`).
    """

    def __init__(self, directory: str | pathlib.Path, *, max_staleness: int | None,
                 current_version_fn: Callable[[], int], follow: bool = True,
                 poll_interval_s: float = 0.5, timeout_s: float | None = None):
        super().__init__()
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"TrajectoryShardReader: max_staleness={max_staleness} must be >= 0 "
                             "(or None for no bound).")
        self.directory = pathlib.Path(directory)
        self.max_staleness = max_staleness
        self.current_version_fn = current_version_fn
        self.follow = follow
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self._consumed: list[str] = []
        self._consumed_set: set[str] = set()
        self._dropped_stale = 0

    # -- staleness ---------------------------------------------------------

    def is_stale(self, policy_version: int) -> bool:
        """Whether data of `policy_version` is past the staleness bound now."""
        if self.max_staleness is None:
            return False
        return policy_version < int(self.current_version_fn()) - self.max_staleness

    # -- reading -----------------------------------------------------------

    def _mark(self, name: str) -> None:
        self._consumed.append(name)
        self._consumed_set.add(name)

    def poll(self) -> TrajectoryShard | None:
        """The next fresh shard now, or None (never waits). Stale shards are skipped."""
        self._assert_not_closed()
        if not self.directory.is_dir():
            return None
        for path in list_shards(self.directory):
            name = path.name
            if name in self._consumed_set:
                continue
            try:
                header, trajectories = read_shard(path)
            except FileNotFoundError:  # removed since the listing: it never counted
                continue
            version = int(header.get("policy_version", 0))
            self._mark(name)
            if self.is_stale(version):
                self._dropped_stale += 1
                continue
            return TrajectoryShard(name=name, policy_version=version, header=dict(header),
                                   trajectories=trajectories)
        return None

    def __next__(self) -> TrajectoryShard:
        start = time.monotonic()
        while True:
            shard = self.poll()
            if shard is not None:
                return shard
            if not self.follow:
                raise StopIteration
            waited = time.monotonic() - start
            if self.timeout_s is not None and waited >= self.timeout_s:
                raise TimeoutError(
                    f"TrajectoryShardReader: no fresh shard in {self.directory} after "
                    f"{waited:.1f}s (timeout_s={self.timeout_s}); are the rollout workers "
                    f"running and writing *{SHARD_SUFFIX} there? ({self._dropped_stale} stale "
                    "shards dropped so far.)")
            time.sleep(self.poll_interval_s)

    def read(self, name: str) -> TrajectoryShard:
        """Re-reads a shard by name (the batcher's restore uses it)."""
        path = self.directory / name
        try:
            header, trajectories = read_shard(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"trajectory shard {path} is named in the restored data state but no longer "
                "exists; keep shards until the checkpoints that mention them are gone.") from None
        return TrajectoryShard(name=name, policy_version=int(header.get("policy_version", 0)),
                               header=dict(header), trajectories=trajectories)

    # -- state -------------------------------------------------------------

    @property
    def consumed(self) -> list[str]:
        """Names of the shards read or dropped so far, in order."""
        return list(self._consumed)

    @property
    def dropped_stale(self) -> int:
        return self._dropped_stale

    def get_state(self) -> dict[str, Any]:
        return {"format": READER_STATE_FORMAT, "consumed": list(self._consumed),
                "dropped_stale": self._dropped_stale}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("format") != READER_STATE_FORMAT:
            raise ValueError(f"TrajectoryShardReader.set_state: not a reader state (format "
                             f"{READER_STATE_FORMAT!r}): {json.dumps(state)[:200]}; pass what "
                             "get_state() returned.")
        self._consumed = [str(name) for name in state["consumed"]]
        self._consumed_set = set(self._consumed)
        self._dropped_stale = int(state["dropped_stale"])

    def __str__(self) -> str:
        return f"TrajectoryShardReader({self.directory})"


class TrajectoryShardDataset(grain.IterDataset):
    """A Grain `IterDataset` of the fresh shards of a directory (`TrajectoryShardReader`).

    `iter(dataset)` gives a new reader; Grain transformations (`.map`,
    `.filter`, ...) chain as usual and their iterators checkpoint the reader's
    state with their own.
    """

    def __init__(self, directory: str | pathlib.Path, **reader_options: Any):
        super().__init__()
        self.directory = pathlib.Path(directory)
        self.reader_options = reader_options

    def __iter__(self) -> TrajectoryShardReader:
        return TrajectoryShardReader(self.directory, **self.reader_options)

    def __str__(self) -> str:
        return f"TrajectoryShardDataset({self.directory})"


# ---------------------------------------------------------------------------
# Batcher.
# ---------------------------------------------------------------------------


class TrajectoryBatch(NamedTuple):
    """One fixed-shape batch and where its rows came from.

    Attributes:
      batch: the padded `Batch` (`rows` rows).
      trajectories: the real rows' trajectories, in row order.
      policy_versions: `[rows]` int, the version that generated each row
        (−1 on padding rows); `current − policy_versions` is the staleness.
      shards: names of the shards the rows came from.
    """

    batch: Batch
    trajectories: list[Trajectory]
    policy_versions: np.ndarray
    shards: list[str]


def _check_groups(shard: TrajectoryShard, group_size: int) -> None:
    trajectories = shard.trajectories
    if len(trajectories) % group_size:
        raise ValueError(f"trajectory shard {shard.name} holds {len(trajectories)} trajectories, "
                         f"not whole groups of group_size={group_size}; write whole groups per "
                         "shard (or set group_size to the rollout's).")
    for start in range(0, len(trajectories), group_size):
        ids = {t.prompt_id for t in trajectories[start:start + group_size]}
        if len(ids) != 1:
            raise ValueError(f"trajectory shard {shard.name}: trajectories {start}.."
                             f"{start + group_size - 1} mix prompts {sorted(ids)}; each group "
                             f"of group_size={group_size} must share one prompt_id.")


class TrajectoryBatcher(grain.DatasetIterator):
    """Cuts a shard stream into `TrajectoryBatch`es of `rows // group_size` whole groups.

    `next()` fills a batch with the next groups, reading shards as needed (so
    it waits as the reader waits); when a non-following reader runs out it
    returns the last, partly padded batch, then stops. Its state (the reader's
    plus the held shards and their offsets) resumes at the next unused group.

    Args:
      reader: a `TrajectoryShardReader`.
      group_size, rows, max_length, max_steps, max_turns, checklist_shape:
        as in `batches()`.
    """

    def __init__(self, reader: TrajectoryShardReader, *, group_size: int, rows: int,
                 max_length: int, max_steps: int, max_turns: int,
                 checklist_shape: tuple[int, int, int] | None = None):
        super().__init__(reader)
        if group_size < 1 or rows < group_size or rows % group_size:
            raise ValueError(f"TrajectoryBatcher: rows={rows} must be a positive multiple of "
                             f"group_size={group_size}.")
        self.reader = reader
        self.group_size = group_size
        self.rows = rows
        self.shape = dict(max_length=max_length, max_steps=max_steps, max_turns=max_turns,
                          checklist_shape=checklist_shape)
        # Held shards and how many of their trajectories were already emitted.
        self._held: collections.deque[list] = collections.deque()
        self._dropped_stale_trajectories = 0

    def _hold(self, shard: TrajectoryShard, offset: int = 0) -> None:
        _check_groups(shard, self.group_size)
        self._held.append([shard, offset])

    def _drop_stale_held(self) -> None:
        for entry in list(self._held):
            shard, offset = entry
            if self.reader.is_stale(shard.policy_version):
                self._dropped_stale_trajectories += len(shard.trajectories) - offset
                self._held.remove(entry)

    def __next__(self) -> TrajectoryBatch:
        self._assert_not_closed()
        wanted = self.rows
        while True:
            self._drop_stale_held()
            available = sum(len(s.trajectories) - o for s, o in self._held)
            if available >= wanted:
                break
            try:
                self._hold(next(self.reader))
            except StopIteration:
                if available == 0:
                    raise
                wanted = available
                break
        taken: list[Trajectory] = []
        versions: list[int] = []
        names: list[str] = []
        while len(taken) < wanted:
            shard, offset = self._held[0]
            count = min(wanted - len(taken), len(shard.trajectories) - offset)
            taken.extend(shard.trajectories[offset:offset + count])
            versions.extend([shard.policy_version] * count)
            names.append(shard.name)
            if offset + count == len(shard.trajectories):
                self._held.popleft()
            else:
                self._held[0][1] = offset + count
        batch = batches(taken, group_size=self.group_size, rows=self.rows, **self.shape)
        policy_versions = np.full(self.rows, -1, np.int64)
        policy_versions[:len(versions)] = versions
        return TrajectoryBatch(batch=batch, trajectories=taken, policy_versions=policy_versions,
                               shards=names)

    def stats(self) -> dict[str, int]:
        """Counters for the metrics: shards read/dropped, trajectories dropped as stale."""
        return {"shards_consumed": len(self.reader.consumed),
                "shards_dropped_stale": self.reader.dropped_stale,
                "trajectories_dropped_stale": self._dropped_stale_trajectories}

    def get_state(self) -> dict[str, Any]:
        return {"format": BATCHER_STATE_FORMAT, "reader": self.reader.get_state(),
                "held": [[shard.name, offset] for shard, offset in self._held],
                "dropped_stale_trajectories": self._dropped_stale_trajectories}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("format") != BATCHER_STATE_FORMAT:
            raise ValueError(f"TrajectoryBatcher.set_state: not a batcher state (format "
                             f"{BATCHER_STATE_FORMAT!r}); pass what get_state() returned.")
        self.reader.set_state(state["reader"])
        self._held.clear()
        for name, offset in state["held"]:
            self._hold(self.reader.read(name), int(offset))
        self._dropped_stale_trajectories = int(state["dropped_stale_trajectories"])

    def __str__(self) -> str:
        return f"TrajectoryBatcher(rows={self.rows}, group_size={self.group_size})"

