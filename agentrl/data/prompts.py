"""Prompt datasets (Grain): built-in task instances, JSONL files, ArrayRecord files.

    dataset = prompt_dataset("prompts.jsonl", seed=0)     # a grain.MapDataset of TaskInstance
    prompts = PromptIterator("prompts.jsonl", seed=0)     # or PromptIterator(dataset)
    batch = prompts.next_batch(8)                         # the next 8 records
    state = prompts.get_state()                           # JSON: checkpoint it
    resumed = PromptIterator("prompts.jsonl", seed=0)
    resumed.set_state(state)                              # continues with record 9

Sources.

* A Python sequence (e.g. `get_task("arithmetic").instances(1000, seed=0)`):
  the dataset indexes it; its items are returned unchanged, except `dict`
  items, which are parsed with the JSONL schema below.
* A `.jsonl` file: one JSON object per line (blank lines are skipped), read and
  validated eagerly, so a bad line fails at start-up, naming the file, the line
  and the field.
* An `.array_record` file: one record per prompt, each the UTF-8 JSON of one
  object of the same schema; read lazily through Grain's
  `ArrayRecordDataSource` (random access, for datasets too big for memory).
  Errors name the file and the record index.

Record schema (JSONL line or ArrayRecord record):

    {"id": "q-17",                                    # str or int, unique: the group key
     "messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."}],  # the prompt, >= 1 message
     "golds": ["42"],                                  # accepted answers (may be [])
     "tools": [{"type": "function", "function": {...}}],  # optional tool schemas
     "demonstration": [{"role": ..., ...}, ...],       # optional SFT dialogue
     "metadata": {...}}                                # optional, free-form

Each record becomes an `agentrl.envs.tasks.TaskInstance` (prompt =
`PromptSpec(prompt_id=id, messages, tools, metadata={"golds": golds, **metadata})`),
the same type the built-in tasks produce, so the trainer treats both alike.

Determinism. Order is a pure function of `(seed, source size)`: Grain's
index shuffle (`MapDataset.shuffle`), reshuffled every epoch with
`repeat=True`. `PromptIterator.get_state()` holds Grain's iterator state
(`{"next_index": ...}`) and a fingerprint of the dataset; restoring it resumes
the exact sequence. (Grain's index shuffle costs milliseconds per record on
datasets of a few dozen records, microseconds from a few hundred on.)
"""

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import grain

from agentrl.envs.tasks.base import TaskInstance
from agentrl.rollout.agent_loop import PromptSpec

JSONL_SUFFIXES = (".jsonl",)
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
REQUIRED_FIELDS = ("id", "messages", "golds")
OPTIONAL_FIELDS = ("tools", "demonstration", "metadata")
STATE_FORMAT = "agentrl-prompts-v1"


def parse_prompt_record(record: Any, *, where: str) -> TaskInstance:
    """Validates one schema record and returns its `TaskInstance`.

    Args:
      record: the decoded JSON object.
      where: where it came from (`"prompts.jsonl line 3"`), for error messages.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}; "
                         f"each prompt is an object with fields {list(REQUIRED_FIELDS)}.")
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; every prompt record needs "
                         f"{list(REQUIRED_FIELDS)} (optional: {list(OPTIONAL_FIELDS)}).")
    unknown = sorted(set(record) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are "
                         f"{list(REQUIRED_FIELDS + OPTIONAL_FIELDS)} (put anything else under "
                         "'metadata').")
    prompt_id = record["id"]
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, str | int) or prompt_id == "":
        raise ValueError(f"{where}: field 'id' = {prompt_id!r} must be a non-empty string or an "
                         "integer.")
    messages = _messages(record["messages"], "messages", where, allow_empty=False)
    golds = record["golds"]
    if not isinstance(golds, list) or not all(isinstance(g, str) for g in golds):
        raise ValueError(f"{where}: field 'golds' = {golds!r} must be a list of strings "
                         "(e.g. [\"42\"]; [] when a judge scores the answer).")
    tools = record.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(f"{where}: field 'tools' must be a list of tool-schema objects "
                         "({\"type\": \"function\", \"function\": {...}}).")
    demonstration = _messages(record.get("demonstration", []), "demonstration", where,
                              allow_empty=True)
    metadata = record.get("metadata", {})
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where}: field 'metadata' = {metadata!r} must be a JSON object.")
    prompt = PromptSpec(prompt_id=str(prompt_id), messages=messages,
                        tools=tuple(dict(t) for t in tools),
                        metadata={"golds": list(golds), **metadata})
    return TaskInstance(prompt=prompt, golds=tuple(golds), demonstration=demonstration,
                        metadata=dict(metadata))


def _messages(value: Any, field: str, where: str, *, allow_empty: bool) -> tuple[dict, ...]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ValueError(f"{where}: field '{field}' must be a {'' if allow_empty else 'non-empty '}"
                         "list of message objects ({\"role\": ..., \"content\": ...}).")
    for index, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: {field}[{index}] = {message!r} must be an object with a "
                             "string 'role' (and 'content').")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: {field}[{index}].content must be a string or null, got "
                             f"{type(content).__name__}.")
    return tuple(dict(m) for m in value)


def read_jsonl_prompts(path: str | pathlib.Path) -> list[TaskInstance]:
    """Reads and validates a JSONL prompt file (ids must be unique)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist; pass a .jsonl file of "
                                "prompt records (see agentrl.data.prompts).")
    instances, first_line = [], {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})"
                                 "; each line must hold one JSON object.") from None
            instance = parse_prompt_record(record, where=where)
            prompt_id = instance.prompt.prompt_id
            if prompt_id in first_line:
                raise ValueError(f"{where}: id {prompt_id!r} repeats line "
                                 f"{first_line[prompt_id]}; ids must be unique (they key the "
                                 "rollout groups).")
            first_line[prompt_id] = number
            instances.append(instance)
    if not instances:
        raise ValueError(f"prompt file {path} holds no records; write one JSON object per line.")
    return instances


def write_array_record_prompts(path: str | pathlib.Path,
                               records: Sequence[Mapping[str, Any]]) -> pathlib.Path:
    """Writes schema records (dicts) to an ArrayRecord file, validating each first."""
    from array_record.python import array_record_module

    path = pathlib.Path(path)
    for index, record in enumerate(records):
        parse_prompt_record(record, where=f"records[{index}]")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    try:
        for record in records:
            writer.write(json.dumps(record).encode("utf-8"))
    finally:
        writer.close()
    return path


class _ArrayRecordPrompts:
    """Lazily decoded prompt records of an ArrayRecord file."""

    def __init__(self, path: pathlib.Path):
        self._path = path
        self._source = grain.sources.ArrayRecordDataSource([str(path)])

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> TaskInstance:
        where = f"{self._path} record {index}"
        raw = self._source[index]
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{where}: not UTF-8 JSON ({error}); each record must be the "
                             "UTF-8 JSON of one prompt object.") from None
        return parse_prompt_record(record, where=where)

    def __repr__(self) -> str:
        return f"ArrayRecordPrompts({self._path})"


def _array_record_source(path: pathlib.Path) -> _ArrayRecordPrompts:
    try:
        import array_record.python.array_record_module  # noqa: F401
    except ImportError as error:  # pragma: no cover - array_record ships with grain here
        raise NotImplementedError(
            f"reading {path} needs the 'array-record' package ({error}); "
            "`pip install array-record`, or convert the prompts to JSONL.") from None
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist.")
    source = _ArrayRecordPrompts(path)
    if len(source) == 0:
        raise ValueError(f"prompt file {path} holds no records.")
    return source


class _ParsedList(Sequence):
    """A list whose dict items are parsed with the prompt schema on access."""

    def __init__(self, items: Sequence[Any]):
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        item = self._items[index]
        if isinstance(item, Mapping):
            return parse_prompt_record(item, where=f"records[{index}]")
        return item


def _source(source: Any) -> Sequence[Any]:
    if isinstance(source, str | pathlib.Path):
        path = pathlib.Path(source)
        suffix = path.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            return read_jsonl_prompts(path)
        if suffix in ARRAY_RECORD_SUFFIXES:
            return _array_record_source(path)
        raise ValueError(f"prompt source {path}: unknown suffix {suffix!r}; use "
                         f"{list(JSONL_SUFFIXES + ARRAY_RECORD_SUFFIXES)} or pass a list of "
                         "records.")
    if isinstance(source, Sequence):
        if len(source) == 0:
            raise ValueError("prompt source: the list of records is empty.")
        return _ParsedList(source)
    raise TypeError(f"prompt source of type {type(source).__name__} is not supported; pass a "
                    "list of records (e.g. task instances), a .jsonl path or an .array_record "
                    "path.")


def prompt_dataset(source: Any, *, seed: int, shuffle: bool = True, repeat: bool = True,
                   shard_index: int = 0, shard_count: int = 1) -> grain.MapDataset:
    """A Grain `MapDataset` of prompt records (see the module docstring for sources).

    Args:
      source: a sequence of records, or a `.jsonl` / `.array_record` path.
      seed: the shuffle seed; the same seed gives the same order.
      shuffle: shuffle (reshuffled every epoch when repeating).
      repeat: repeat forever (else one pass).
      shard_index, shard_count: this process's slice (`index::count`) of one
        global order, so the hosts of a multi-host job read disjoint prompts.
    """
    return _dataset(_source(source), seed=seed, shuffle=shuffle, repeat=repeat,
                    shard_index=shard_index, shard_count=shard_count)


def _dataset(records: Sequence[Any], *, seed: int, shuffle: bool, repeat: bool,
             shard_index: int, shard_count: int) -> grain.MapDataset:
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"prompt_dataset: shard_index={shard_index} must be in "
                         f"[0, shard_count={shard_count}).")
    dataset = grain.MapDataset.source(records)
    if shuffle:
        dataset = dataset.seed(seed).shuffle()
    if repeat:
        dataset = dataset.repeat(None)
    if shard_count > 1:
        dataset = dataset[shard_index::shard_count]
    return dataset


class PromptIterator:
    """The next prompts of a prompt dataset, with a JSON-serialisable state.

    `PromptIterator(source, seed=0, ...)` builds the dataset (same arguments as
    `prompt_dataset`) and records a fingerprint (seed, options, number of
    records) in its state, so `set_state` refuses the state of another
    dataset. `PromptIterator(dataset)` wraps any `grain.MapDataset` (no
    fingerprint check).
    """

    def __init__(self, source: Any, *, seed: int | None = None, shuffle: bool = True,
                 repeat: bool = True, shard_index: int = 0, shard_count: int = 1):
        if isinstance(source, grain.MapDataset):
            if seed is not None:
                raise TypeError("PromptIterator: seed applies only when it builds the dataset "
                                "from a source; pass it to prompt_dataset instead.")
            self._dataset, self._fingerprint = source, None
        else:
            if seed is None:
                raise TypeError("PromptIterator: pass seed=... (the shuffle seed) with a source.")
            records = _source(source)
            self._dataset = _dataset(records, seed=seed, shuffle=shuffle, repeat=repeat,
                                     shard_index=shard_index, shard_count=shard_count)
            self._fingerprint = {"seed": seed, "shuffle": shuffle, "repeat": repeat,
                                 "shard_index": shard_index, "shard_count": shard_count,
                                 "size": len(records)}
        self._iterator = self._new_iterator()
        self._exhausted = False

    def _new_iterator(self) -> grain.DatasetIterator:
        # Records are cheap to produce: read in this thread, no prefetch buffer, so nothing is
        # read ahead of what next_batch returns.
        return iter(self._dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    @property
    def dataset(self) -> grain.MapDataset:
        return self._dataset

    def next_batch(self, n: int) -> list[Any]:
        """The next `n` records; fewer (possibly none) only when a non-repeating dataset ends."""
        if n < 1:
            raise ValueError(f"PromptIterator.next_batch: n={n} must be >= 1.")
        records = []
        while len(records) < n and not self._exhausted:
            try:
                records.append(next(self._iterator))
            except StopIteration:
                self._exhausted = True
        return records

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        batch = self.next_batch(1)
        if not batch:
            raise StopIteration
        return batch[0]

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable: Grain's iterator state plus the dataset fingerprint."""
        return {"format": STATE_FORMAT, "grain": self._iterator.get_state(),
                "fingerprint": self._fingerprint}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resumes from a `get_state()` of an iterator over the same dataset."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"PromptIterator.set_state: {state!r} is not a prompt iterator state "
                             f"(format {STATE_FORMAT!r}); pass what get_state() returned.")
        stored = state.get("fingerprint")
        if stored is not None and self._fingerprint is not None and stored != self._fingerprint:
            raise ValueError(f"PromptIterator.set_state: the state belongs to dataset {stored}, "
                             f"this iterator reads {self._fingerprint}; resume with the same "
                             "source, seed and options.")
        self._iterator = self._new_iterator()
        self._iterator.set_state(dict(state["grain"]))
        self._exhausted = False


def read_prompts(path: str | pathlib.Path) -> list[TaskInstance]:
    """Every record of a JSONL or ArrayRecord prompt file, as `TaskInstance`s."""
    return [record for record in _source(pathlib.Path(path))]
