"""Adversarial model outputs and hypothesis strategies shared by the reward tests."""

import json

from hypothesis import settings
from hypothesis import strategies as st

PROPERTY = settings(max_examples=100, deadline=None)

TAG_FRAGMENTS = [
    "<think>", "</think>", "<answer>", "</answer>", "<search>", "</search>",
    "<information>", "</information>", "<reasoning>", "</reasoning>", "<tool>", "</tool>",
    "<result>", "</result>", "<tool_call>", "</tool_call>", "< reasoning>", "</answer >",
    "<think id='1'>", "<br/>", "<", ">", "</", "{", "}", "[", "]", '"', ":", ",",
    '{"name": "search", "arguments": {"q": "x"}}', '{"name": 1}', "[]", "null", "42",
    "\\boxed{", "Error:", "paris", "The", " ", "\n", "\x00", "\ud800",
]

ADVERSARIAL = [
    "",
    " ",
    "\n\t",
    "<",
    "</",
    "<>",
    "</>",
    "<think>",
    "</think>",
    "<think><think></think>",
    "<think>a</think></think>",
    "<answer></answer></answer>",
    "<answer><answer>x</answer>",
    "<think><answer><think>x</answer></think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_call></tool_call>",
    "<tool_call>not json</tool_call>",
    "<tool_call>{</tool_call>",
    "<tool_call>[]</tool_call>",
    "<tool_call>null</tool_call>",
    "<tool_call>42</tool_call>",
    '<tool_call>"a string"</tool_call>',
    '<tool_call>[1, "a", null]</tool_call>',
    '<tool_call>{"name": 1, "arguments": []}</tool_call>',
    '<tool_call>{"name": "x"}</tool_call>',
    '<tool_call>{"name": "x", "arguments": "{}"}</tool_call>',
    '<tool_call>{"name": "x", "arguments": {"v": NaN}}</tool_call>',
    '<tool_call>{"name": "x", "arguments": {}}',
    "<tool_call>" + "[" * 50_000 + "]" * 50_000 + "</tool_call>",
    "<tool_call>" + "{" * 50_000 + "</tool_call>",
    "<tool_call>" + json.dumps([{"name": f"t{i}", "arguments": {"i": i}} for i in range(5_000)])
    + "</tool_call>",
    "<tool_call>" * 5_000,
    "</tool_call>" * 5_000,
    "<think>" + "a" * 200_000,
    "<" + " " * 100_000,
    "<a" + "b" * 100_000,
    "\\boxed{" * 1_000,
    "\\boxed{{{}",
    "\\boxed{}",
    "< think>x</think>",
    "<THINK>x</THINK>",
    "<reasoning >x</reasoning>",
    "\x00\ud800\U0010ffff",
    "Error:",
    "<result>Error: nope</result>",
]

# Texts stitched from tag fragments and random text: mostly-malformed markup.
model_text = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.sampled_from(TAG_FRAGMENTS), st.text(max_size=8)), max_size=25).map(
        "".join
    ),
)
