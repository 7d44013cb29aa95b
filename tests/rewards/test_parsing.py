"""Tag blocks and Hermes tool-call parsing (agentrl/rewards/parsing.py)."""

import json

import pytest
from hypothesis import given

from agentrl.rewards import (
    count_tag,
    extract_tag,
    find_tag_blocks,
    parse_json,
    parse_tool_call_blocks,
    parse_tool_calls,
    tag_tokens,
)
from tests.rewards.strategies import ADVERSARIAL, PROPERTY, model_text

CALL_A = {"name": "search", "arguments": {"query": "paris"}}
CALL_B = {"name": "calc", "arguments": {"expr": "1+1"}}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<t>a</t> x <t> b </t>", ["a", " b "]),
        # a closing tag pairs with the nearest opening tag before it
        ("<t>a<t>b</t>", ["b"]),
        # stray closing tag skipped, then a new block
        ("<t>a</t></t><t>c</t>", ["a", "c"]),
        ("x</t><t>y", []),
        ("", []),
    ],
)
def test_find_tag_blocks_pairing(text, expected):
    assert find_tag_blocks(text, "t") == expected


def test_extract_tag_last_block_stripped():
    assert extract_tag("<answer> a </answer><answer>\n b \n</answer>", "answer") == "b"
    assert extract_tag("<answer>unclosed", "answer") is None
    assert extract_tag(None, "answer") is None


def test_extract_tag_on_the_papers_malformed_example():
    # turn_level_credit_mt_grpo_mt_ppo.txt, Table 7
    text = ("<answer><tool>< reasoning> From … </reasoning><answer>Oscar Peterson</answer>"
            "</result><answer>Oscar Peterson</a>")
    assert extract_tag(text, "answer") == "Oscar Peterson"


def test_count_tag():
    assert count_tag("<a></a><a>", "a") == (2, 1)
    assert count_tag("< a>", "a") == (0, 0)


def test_tag_tokens_names_and_canonical_flags():
    tokens = tag_tokens("<think>a</think> 1 < 2 <br/> <b x='1'> < c>")
    assert [(t.name, t.closing, t.canonical) for t in tokens] == [
        ("think", False, True),
        ("think", True, True),
        ("br", False, False),
        ("b", False, False),
    ]
    assert tokens[0].start == 0 and tokens[0].end == len("<think>")


def test_parse_json_never_raises():
    assert parse_json('{"a": 1}') == ({"a": 1}, None)
    value, err = parse_json("{")
    assert value is None and "JSONDecodeError" in err
    value, err = parse_json("[" * 100_000)
    assert value is None and err


def test_parse_tool_calls_single_object():
    text = f"<think>x</think><tool_call>{json.dumps(CALL_A)}</tool_call>"
    assert parse_tool_calls(text) == ([CALL_A], [])


def test_parse_tool_calls_array_and_several_blocks_concatenate():
    text = (f"<tool_call>\n{json.dumps([CALL_A, CALL_B])}\n</tool_call>"
            f"<tool_call>{json.dumps(CALL_B)}</tool_call>")
    calls, errors = parse_tool_calls(text)
    assert calls == [CALL_A, CALL_B, CALL_B]
    assert errors == []


def test_parse_tool_calls_reports_each_problem():
    text = ("<tool_call>not json</tool_call>"
            f"<tool_call>{json.dumps([CALL_A, 3, {'name': 1, 'arguments': {}}])}</tool_call>"
            '<tool_call>{"name": "x", "arguments": "{}"}</tool_call>'
            "<tool_call>{")
    parsed = parse_tool_call_blocks(text)
    assert parsed.calls == [CALL_A]
    assert parsed.n_blocks == 3
    assert not parsed.json_ok  # block 0 is not JSON
    assert not parsed.fields_ok
    assert len(parsed.items) == 4  # 3 from the array + 1 object
    messages = " | ".join(parsed.errors)
    assert "unclosed or stray" in messages
    assert "block 0: invalid JSON" in messages
    assert "call 1: expected a JSON object, got int" in messages
    assert "call 2: missing a string 'name'" in messages
    assert "call 3: missing a dict 'arguments'" in messages


def test_parse_tool_call_blocks_flags():
    empty = parse_tool_call_blocks("<tool_call>[]</tool_call>")
    assert (empty.json_ok, empty.fields_ok, empty.items) == (True, False, [])
    scalar = parse_tool_call_blocks("<tool_call>42</tool_call>")
    assert (scalar.json_ok, scalar.fields_ok) == (False, False)
    none = parse_tool_call_blocks("no calls here")
    assert (none.n_blocks, none.json_ok, none.errors) == (0, False, [])


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_parsers_never_raise_on_adversarial_text(text):
    calls, errors = parse_tool_calls(text)
    assert all(isinstance(c["name"], str) and isinstance(c["arguments"], dict) for c in calls)
    assert all(isinstance(e, str) for e in errors)
    assert isinstance(find_tag_blocks(text, "think"), list)
    assert isinstance(tag_tokens(text), list)


@PROPERTY
@given(model_text)
def test_tool_call_parse_invariants(text):
    parsed = parse_tool_call_blocks(text)
    assert parsed.calls == [
        c for c in parsed.items
        if isinstance(c, dict) and isinstance(c.get("name"), str)
        and isinstance(c.get("arguments"), dict)
    ]
    assert parsed.fields_ok == (parsed.json_ok and bool(parsed.items)
                                and len(parsed.calls) == len(parsed.items))
    if parsed.fields_ok and parsed.n_blocks == text.count("<tool_call>") \
            == text.count("</tool_call>"):
        assert parsed.errors == []
    for block in find_tag_blocks(text, "tool_call"):
        assert block in text
