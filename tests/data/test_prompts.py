"""Prompt datasets: sources (task instances, JSONL, ArrayRecord), determinism, state round trip."""

import json

import grain
import pytest

from agentrl.data import PromptIterator, prompt_dataset, write_array_record_prompts
from agentrl.envs.tasks import TaskInstance, get_task


def _records(count):
    return [{"id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i} + 1?"}],
             "golds": [str(i + 1)], "metadata": {"i": i}} for i in range(count)]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _ids(records):
    return [r.prompt.prompt_id for r in records]


# Grain's index shuffle is slow (ms per record) on tiny datasets; a few hundred keep tests fast.
SIZE = 240


@pytest.fixture(scope="module")
def instances():
    return get_task("arithmetic").instances(SIZE, seed=0)


def test_same_seed_same_sequence_and_epochs_reshuffle(instances):
    first = PromptIterator(instances, seed=7).next_batch(3 * SIZE)
    second = PromptIterator(instances, seed=7).next_batch(3 * SIZE)
    other = PromptIterator(instances, seed=8).next_batch(3 * SIZE)
    assert _ids(first) == _ids(second)
    assert _ids(first) != _ids(other)
    # Each epoch is a permutation of the instances, and epochs differ.
    epochs = [_ids(first[i:i + SIZE]) for i in range(0, 3 * SIZE, SIZE)]
    assert all(sorted(epoch) == sorted(_ids(instances)) for epoch in epochs)
    assert epochs[0] != epochs[1]
    assert all(isinstance(r, TaskInstance) for r in first)


def test_no_shuffle_no_repeat_is_source_order_and_ends(instances):
    iterator = PromptIterator(instances, seed=0, shuffle=False, repeat=False)
    assert _ids(iterator.next_batch(5)) == _ids(instances[:5])
    assert _ids(iterator.next_batch(1000)) == _ids(instances[5:])
    assert iterator.next_batch(3) == []


def test_state_round_trip_resumes_exactly(instances):
    reference = _ids(PromptIterator(instances, seed=3).next_batch(SIZE + 60))
    iterator = PromptIterator(instances, seed=3)
    head = _ids(iterator.next_batch(SIZE - 17))  # the resumed part crosses an epoch
    state = json.loads(json.dumps(iterator.get_state()))  # survives JSON
    resumed = PromptIterator(instances, seed=3)
    resumed.set_state(state)
    assert head + _ids(resumed.next_batch(77)) == reference
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(instances, seed=4).set_state(state)
    with pytest.raises(ValueError, match="get_state"):
        resumed.set_state({"next_index": 3})


def test_shards_are_disjoint_slices_of_one_order(instances):
    whole = _ids(PromptIterator(instances, seed=1, repeat=False).next_batch(SIZE))
    parts = [_ids(PromptIterator(instances, seed=1, repeat=False, shard_index=i,
                                 shard_count=3).next_batch(SIZE)) for i in range(3)]
    assert parts[1] == whole[1::3]
    assert sorted(id_ for part in parts for id_ in part) == sorted(whole)


def test_jsonl_source(tmp_path):
    path = _write_jsonl(tmp_path / "prompts.jsonl", _records(SIZE))
    dataset = prompt_dataset(path, seed=0, shuffle=False, repeat=False)
    assert isinstance(dataset, grain.MapDataset)
    first = dataset[2]
    assert first.prompt.prompt_id == "q2" and first.golds == ("3",)
    assert first.prompt.messages[0]["content"] == "What is 2 + 1?"
    assert first.prompt.metadata == {"golds": ["3"], "i": 2} and first.metadata == {"i": 2}
    order = _ids(PromptIterator(path, seed=5).next_batch(SIZE))
    assert order == _ids(PromptIterator(path, seed=5).next_batch(SIZE))
    assert sorted(order) == sorted(f"q{i}" for i in range(SIZE)) and order != sorted(order)


@pytest.mark.parametrize("line, message", [
    ({"id": "a", "messages": [{"role": "user", "content": "x"}]}, r"line 2: missing .*'golds'"),
    ({"id": "a", "messages": [], "golds": []}, r"line 2: field 'messages'"),
    ({"id": "a", "messages": [{"role": "user", "content": "x"}], "golds": "1"},
     r"line 2: field 'golds'"),
    ({"id": "a", "messages": [{"role": "user", "content": "x"}], "golds": [], "gold": 1},
     r"line 2: unknown field\(s\) \['gold'\]"),
    ({"id": "q0", "messages": [{"role": "user", "content": "x"}], "golds": []},
     r"line 2: id 'q0' repeats line 1"),
])
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_records(1)[0]) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=message) as error:
        prompt_dataset(path, seed=0)
    assert str(path) in str(error.value)


def test_jsonl_invalid_json_and_missing_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1,\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 1: not valid JSON"):
        prompt_dataset(path, seed=0)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        prompt_dataset(tmp_path / "nope.jsonl", seed=0)
    with pytest.raises(ValueError, match=r"unknown suffix '\.csv'"):
        prompt_dataset(tmp_path / "p.csv", seed=0)


def test_array_record_source_matches_jsonl(tmp_path):
    records = _records(SIZE)
    jsonl = _write_jsonl(tmp_path / "p.jsonl", records)
    array_record = write_array_record_prompts(tmp_path / "p.array_record", records)
    from_jsonl = PromptIterator(jsonl, seed=2).next_batch(SIZE + 20)
    iterator = PromptIterator(array_record, seed=2)
    from_array_record = iterator.next_batch(SIZE - 11)
    state = iterator.get_state()
    resumed = PromptIterator(array_record, seed=2)
    resumed.set_state(state)
    from_array_record += resumed.next_batch(31)
    assert _ids(from_array_record) == _ids(from_jsonl)
    assert [r.golds for r in from_array_record] == [r.golds for r in from_jsonl]


def test_array_record_bad_record_names_index(tmp_path):
    from array_record.python import array_record_module

    path = tmp_path / "bad.array_record"
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    writer.write(json.dumps(_records(1)[0]).encode())
    writer.write(json.dumps({"id": "x", "messages": [{"role": "user"}]}).encode())
    writer.close()
    dataset = prompt_dataset(path, seed=0, shuffle=False)
    assert dataset[0].prompt.prompt_id == "q0"
    with pytest.raises(ValueError, match=r"bad.array_record record 1: missing .*'golds'"):
        dataset[1]


def test_dict_records_in_a_list_are_parsed():
    records = PromptIterator(_records(3), seed=0, shuffle=False).next_batch(3)
    assert _ids(records) == ["q0", "q1", "q2"]
    with pytest.raises(ValueError, match=r"records\[0\]: missing"):
        PromptIterator([{"id": 1}], seed=0).next_batch(1)
