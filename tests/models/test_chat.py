"""Qwen ChatML rendering, token deltas and assistant parsing (agentrl/models/chat.py)."""

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.models import chat
from agentrl.models.chat import (
    ParsedAssistant,
    chat_flavour,
    encode_messages,
    parse_assistant,
    render_delta,
    render_delta_text,
    render_messages,
)
from agentrl.models.tokenizer import get_tokenizer
from agentrl.rewards import parsing
from tests.rewards.strategies import ADVERSARIAL, model_text

PROPERTY = settings(max_examples=60, deadline=None)
FLAVOURS = ["qwen2.5", "qwen3"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def weather_call(city):
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


DIALOGUE = [
    {"role": "system", "content": "You are a travel assistant."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [weather_call("Paris"), weather_call("Tokyo")]},
    {"role": "tool", "content": '{"temp_c": 18}'},
    {"role": "tool", "content": '{"temp_c": 24}'},
    {"role": "assistant", "content": "Paris 18 °C, Tokyo 24 °C.", "reasoning_content": "Both."},
    {"role": "user", "content": "And Berlin?"},
]
TOOLS_SECTION = (
    "# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather'
    ' of a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},'
    ' "required": ["city"]}}}\n'
    "</tools>\n"
    "\n"
    "For each function call, return a json object with function name and arguments within"
    " <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
PARIS_TOKYO_CALLS = (
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
    "</tool_call><|im_end|>\n"
)
TOOL_RESULTS = (
    "<|im_start|>user\n"
    "<tool_response>\n"
    '{"temp_c": 18}\n'
    "</tool_response>\n"
    "<tool_response>\n"
    '{"temp_c": 24}\n'
    "</tool_response><|im_end|>\n"
)
# Both templates render the whole dialogue the same way: the system message is
# given, and Qwen3 drops the reasoning of turns before the last user query.
EXPECTED_DIALOGUE = (
    "<|im_start|>system\nYou are a travel assistant.\n\n" + TOOLS_SECTION
    + "<|im_start|>user\nWeather in Paris and Tokyo?<|im_end|>\n"
    + "<|im_start|>assistant\n" + PARIS_TOKYO_CALLS
    + TOOL_RESULTS
    + "<|im_start|>assistant\nParis 18 °C, Tokyo 24 °C.<|im_end|>\n"
    + "<|im_start|>user\nAnd Berlin?<|im_end|>\n"
    + "<|im_start|>assistant\n"
)
# Qwen3 within one query: the assistant turns after it keep their reasoning.
EXPECTED_QWEN3_ONE_QUERY = (
    "<|im_start|>system\nYou are a travel assistant.\n\n" + TOOLS_SECTION
    + "<|im_start|>user\nWeather in Paris and Tokyo?<|im_end|>\n"
    + "<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n" + PARIS_TOKYO_CALLS
    + TOOL_RESULTS
    + "<|im_start|>assistant\n<think>\nBoth.\n</think>\n\nParis 18 °C, Tokyo 24 °C.<|im_end|>\n"
)
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tool_dialogue_renders_exactly(flavour):
    rendered = render_messages(DIALOGUE, tools=TOOLS, add_generation_prompt=True, flavour=flavour)
    assert rendered == EXPECTED_DIALOGUE


def test_qwen3_keeps_reasoning_after_the_last_query():
    assert render_messages(DIALOGUE[:6], tools=TOOLS, flavour="qwen3") == EXPECTED_QWEN3_ONE_QUERY
    # Qwen2.5 has no reasoning handling: reasoning_content is ignored.
    qwen25 = render_messages(DIALOGUE[:6], tools=TOOLS, flavour="qwen2.5")
    assert "<think>" not in qwen25 and qwen25 == EXPECTED_DIALOGUE.rsplit("<|im_start|>user", 1)[0]


@pytest.mark.parametrize(
    ("flavour", "tools", "expected_start"),
    [
        ("qwen2.5", None, f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n"),
        ("qwen2.5", TOOLS, f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n{TOOLS_SECTION}"
                           "<|im_start|>user\n"),
        ("qwen3", None, "<|im_start|>user\n"),
        ("qwen3", TOOLS, f"<|im_start|>system\n{TOOLS_SECTION}<|im_start|>user\n"),
    ],
)
def test_default_system_message(flavour, tools, expected_start):
    rendered = render_messages([{"role": "user", "content": "Hi"}], tools=tools, flavour=flavour)
    assert rendered == expected_start + "Hi<|im_end|>\n"


@pytest.mark.parametrize(
    ("flavour", "enable_thinking", "expected_end"),
    [
        ("qwen2.5", True, "<|im_start|>assistant\n"),
        ("qwen2.5", False, "<|im_start|>assistant\n"),  # the Qwen2.5 template ignores it
        ("qwen3", True, "<|im_start|>assistant\n"),
        ("qwen3", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)
def test_generation_prompt(flavour, enable_thinking, expected_end):
    messages = [{"role": "user", "content": "Hi"}]
    without = render_messages(messages, flavour=flavour)
    with_prompt = render_messages(messages, add_generation_prompt=True, flavour=flavour,
                                  enable_thinking=enable_thinking)
    assert with_prompt == without + expected_end


def test_qwen3_assistant_turn_details():
    user = {"role": "user", "content": "q"}
    # The last turn always shows a think block; the content's own block is split off.
    last = render_messages([user, {"role": "assistant", "content": "A"}], flavour="qwen3")
    assert last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n")
    split = render_messages([user, {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"},
                             user], flavour="qwen3")
    assert "<|im_start|>assistant\nA<|im_end|>" in split
    # A user message that only wraps a tool response is not a query.
    wrapped = {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}
    kept = render_messages([user, {"role": "assistant", "content": "A", "reasoning_content": "R"},
                            wrapped], flavour="qwen3")
    assert "<think>\nR\n</think>\n\nA" in kept


@pytest.mark.parametrize(("flavour", "expected"), [
    ("qwen2.5", '{"name": "f", "arguments": "{\\"a\\": 1}"}'),  # tojson quotes the string
    ("qwen3", '{"name": "f", "arguments": {"a": 1}}'),  # inserted verbatim
])
def test_string_arguments_follow_each_template(flavour, expected):
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"name": "f", "arguments": '{"a": 1}'}]}
    assert f"<tool_call>\n{expected}\n</tool_call>" in render_messages([message], flavour=flavour)


def test_non_ascii_json_is_not_escaped():
    message = {"role": "assistant", "content": "", "tool_calls": [weather_call("Zürich 東京")]}
    assert '{"city": "Zürich 東京"}' in render_messages([message], flavour="qwen2.5")


def test_bad_input_raises():
    with pytest.raises(ValueError, match="flavour"):
        render_messages([], flavour="qwen2")
    with pytest.raises(ValueError, match="role"):
        render_messages([{"role": "developer", "content": "x"}])
    with pytest.raises(ValueError, match="content"):
        render_messages([{"role": "user", "content": ["x"]}])
    with pytest.raises(ValueError, match="role"):
        render_delta_text([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="name"):
        render_messages([{"role": "assistant", "content": "", "tool_calls": [{"args": {}}]}])


def test_chat_flavour():
    assert chat_flavour(get_tokenizer("qwen3")) == "qwen3"
    assert chat_flavour(get_tokenizer("qwen2")) == "qwen2.5"


# ---------------------------------------------------------------------------
# Token-in/token-out deltas (SPEC §1).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("flavour", "enable_thinking", "expected"), [
    ("qwen2.5", True, "\n" + TOOL_RESULTS + "<|im_start|>assistant\n"),
    ("qwen3", True, "\n" + TOOL_RESULTS + "<|im_start|>assistant\n"),
    ("qwen3", False, "\n" + TOOL_RESULTS + "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_delta_text(flavour, enable_thinking, expected):
    delta = render_delta_text(DIALOGUE[3:5], flavour=flavour, enable_thinking=enable_thinking)
    assert delta == expected
    tokenizer = get_tokenizer(flavour)
    assert render_delta(tokenizer, DIALOGUE[3:5], enable_thinking=enable_thinking) == \
        tokenizer.encode(expected)


def test_delta_closes_a_cut_generation():
    tokenizer = get_tokenizer("qwen2.5")
    delta = render_delta(tokenizer, [{"role": "user", "content": "go on"}], close_turn=True)
    assert delta[:2] == [tokenizer.special_tokens["<|im_end|>"], *tokenizer.encode("\n")]
    assert tokenizer.decode(delta) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n" \
                                      "<|im_start|>assistant\n"


class SpyTokenizer:
    """Delegates to a real tokenizer and records every text it encodes."""

    def __init__(self, flavour):
        self._tokenizer = get_tokenizer(flavour)
        self.name = self._tokenizer.name
        self.encoded = []

    def encode(self, text, **kwargs):
        self.encoded.append(text)
        return self._tokenizer.encode(text, **kwargs)


def test_delta_encodes_only_the_new_messages():
    spy = SpyTokenizer("qwen3")
    delta = render_delta(spy, DIALOGUE[3:5])
    assert spy.encoded == ["\n" + TOOL_RESULTS + "<|im_start|>assistant\n"]
    assert delta == get_tokenizer("qwen3").encode(spy.encoded[0])


def call_block(city):
    return ('<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            + json.dumps(city, ensure_ascii=False) + "}}\n</tool_call>")


def generation_text(content, cities, reasoning=None):
    """What the policy samples after `<|im_start|>assistant\\n`, in canonical form."""
    think = "" if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n"
    return think + "\n".join([content] * bool(content) + [call_block(c) for c in cities]) \
        + "<|im_end|>"


def rollout(flavour, prompt, steps, check):
    """Token-in/token-out rollout: prompt ids, sampled ids verbatim, deltas appended.

    `steps` is `[(generation_text, environment_messages)]`; after each delta,
    `check(ids, messages)` is called.
    """
    tokenizer = get_tokenizer(flavour)
    ids = encode_messages(tokenizer, prompt, tools=TOOLS, add_generation_prompt=True)
    messages = list(prompt)
    for text, environment in steps:
        ids = ids + tokenizer.encode(text)  # stands in for the sampled ids
        messages.append(parse_assistant(text).to_message())
        before = list(ids)
        ids = ids + render_delta(tokenizer, environment)
        messages += environment
        assert ids[: len(before)] == before
        check(ids, messages)
    return ids, messages


def test_delta_property_qwen25_multi_turn():
    steps = [
        (generation_text("", ["Paris", "Tokyo"]), DIALOGUE[3:5]),
        (generation_text("Paris 18 °C, Tokyo 24 °C.", []), DIALOGUE[6:7]),
        (generation_text("Checking.", ["Berlin"]), [{"role": "tool", "content": "11"}]),
    ]
    ids, _ = rollout("qwen2.5", DIALOGUE[:2], steps, check_rerender("qwen2.5"))
    assert get_tokenizer("qwen2.5").decode(ids).startswith(EXPECTED_DIALOGUE)


def test_delta_property_qwen3_within_a_query_and_across_user_turns():
    tokenizer = get_tokenizer("qwen3")
    first = generation_text("", ["Paris", "Tokyo"], "Two cities: two calls.")
    second = generation_text("Paris 18 °C, Tokyo 24 °C.", [], "Both.")
    ids, messages = rollout("qwen3", DIALOGUE[:2], [(first, DIALOGUE[3:5])], check_rerender(
        "qwen3"))
    assert tokenizer.decode(ids) == EXPECTED_QWEN3_ONE_QUERY.rsplit("<|im_start|>assistant", 1)[0] \
        + "<|im_start|>assistant\n"
    # After a new user query the template rewrites history (drops past reasoning);
    # the rollout keeps what the policy saw.
    ids = ids + tokenizer.encode(second)
    messages.append(parse_assistant(second).to_message())
    ids = ids + render_delta(tokenizer, DIALOGUE[6:7])
    rerendered = render_messages(messages + DIALOGUE[6:7], tools=TOOLS, add_generation_prompt=True,
                                 flavour="qwen3")
    kept = tokenizer.decode(ids)
    assert kept != rerendered
    for reasoning in ["Two cities: two calls.", "Both."]:
        kept = kept.replace(f"<think>\n{reasoning}\n</think>\n\n", "", 1)
    assert kept == rerendered == EXPECTED_DIALOGUE


plain_text = st.text(
    alphabet=st.characters(categories=["L", "N", "P", "S", "Zs"], exclude_characters="<>"),
    min_size=1, max_size=20,
).map(str.strip).filter(bool)
tool_output = st.text(max_size=40)


@st.composite
def tool_steps(draw, with_reasoning, with_users):
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        cities = draw(st.lists(plain_text, min_size=0 if with_users else 1, max_size=2))
        reasoning = draw(plain_text) if with_reasoning else None
        content = draw(st.one_of(st.just(""), plain_text))
        environment = [{"role": "tool", "content": draw(tool_output)} for _ in cities]
        if not environment or (with_users and draw(st.booleans())):
            environment.append({"role": "user", "content": draw(plain_text)})
        steps.append((generation_text(content, cities, reasoning), environment))
    return steps


def check_rerender(flavour):
    """`check` for `rollout`: the rollout's ids are the encoded re-rendered dialogue."""
    tokenizer = get_tokenizer(flavour)

    def check(ids, messages):
        assert ids == encode_messages(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)

    return check


@PROPERTY
@given(tool_steps(with_reasoning=False, with_users=True))
def test_delta_property_qwen25_random_dialogues(steps):
    rollout("qwen2.5", DIALOGUE[:2], steps, check_rerender("qwen2.5"))


@PROPERTY
@given(tool_steps(with_reasoning=True, with_users=False))
def test_delta_property_qwen3_random_tool_chains(steps):
    rollout("qwen3", DIALOGUE[:2], steps, check_rerender("qwen3"))


# ---------------------------------------------------------------------------
# Parsing assistant output.
# ---------------------------------------------------------------------------


def test_parse_qwen3_generation():
    text = generation_text("Let me check.", ["Paris", "Tokyo"], "Two cities.")
    parsed = parse_assistant(text)
    assert parsed == ParsedAssistant(
        content="Let me check.", reasoning="Two cities.",
        tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}},
                    {"name": "get_weather", "arguments": {"city": "Tokyo"}}],
        errors=[])
    assert parsed.to_message() == {"role": "assistant", "content": "Let me check.",
                                   "tool_calls": parsed.tool_calls,
                                   "reasoning_content": "Two cities."}


@pytest.mark.parametrize(("text", "content", "reasoning", "n_calls", "n_errors"), [
    ("Just text.", "Just text.", None, 0, 0),
    ("R\n</think>\n\nC", "C", "R", 0, 0),  # thinking models get <think> in the prompt
    ("<think>\nstill thinking", "", "still thinking", 0, 1),  # cut inside the reasoning
    ("<think>\n<tool_call>\n{\"name\": \"x\", \"arguments\": {}}\n</tool_call>\n</think>\n\nC",
     "C", '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>', 0, 0),
    ("A<think>x</think>B</think>C", "C", "x", 0, 1),
    ("<tool_call>\nnot json\n</tool_call>", "", None, 0, 1),
    ("<tool_call>\n{\"name\": \"x\", \"arguments\": {}}", "<tool_call>\n{\"name\": \"x\", "
     "\"arguments\": {}}", None, 0, 1),
    ("Hi<|im_end|>", "Hi", None, 0, 0),
    ("", "", None, 0, 0),
])
def test_parse_cases(text, content, reasoning, n_calls, n_errors):
    parsed = parse_assistant(text)
    assert (parsed.content, parsed.reasoning) == (content, reasoning)
    assert (len(parsed.tool_calls), len(parsed.errors)) == (n_calls, n_errors)


def test_parse_tool_calls_is_reexported():
    assert chat.parse_tool_calls is parsing.parse_tool_calls


@PROPERTY
@given(st.one_of(st.just(""), plain_text), st.lists(plain_text, max_size=3),
       st.one_of(st.none(), plain_text))
def test_parse_inverts_rendering(content, cities, reasoning):
    parsed = parse_assistant(generation_text(content, cities, reasoning))
    assert parsed.content == content
    assert parsed.reasoning == reasoning
    assert [call["arguments"]["city"] for call in parsed.tool_calls] == cities
    assert parsed.errors == []


def _check_parse(parsed):
    assert isinstance(parsed, ParsedAssistant)
    assert isinstance(parsed.content, str)
    assert parsed.reasoning is None or isinstance(parsed.reasoning, str)
    for call in parsed.tool_calls:
        assert isinstance(call["name"], str) and isinstance(call["arguments"], dict)
    assert all(isinstance(error, str) for error in parsed.errors)


@settings(max_examples=300, deadline=None)
@given(model_text)
def test_parse_never_raises(text):
    parsed = parse_assistant(text)
    _check_parse(parsed)
    if "<think>" not in text and "</think>" not in text:
        assert parsed.reasoning is None


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_parse_adversarial(text):
    _check_parse(parse_assistant(text))


def test_parse_huge_input_is_linear():
    call = '<tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call></tool_call>x'
    text = "<think>" + "a" * 100_000 + "</think>" + call * 50_000
    start = time.perf_counter()
    parsed = parse_assistant(text)
    assert time.perf_counter() - start < 5.0
    assert parsed.reasoning == "a" * 100_000
    assert len(parsed.tool_calls) == 50_000
    assert parsed.content == "<tool_call></tool_call>x" * 50_000
