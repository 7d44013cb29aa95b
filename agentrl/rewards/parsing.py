"""Never-raising parsers for model output: XML-like tag blocks and Hermes tool calls.

Every function here takes arbitrary model text (any `str`, including empty,
unbalanced, nested or huge input; `None` is read as the empty output) and
returns a value; none raises on what a model can write. The scans are linear
in the input length (`str.find` / `str.rfind`, no backtracking regexes), so a
pathological generation cannot stall the reward workers.

Tag pairing rule (used by every reward in `agentrl.rewards`): blocks are read
left to right; each closing tag `</t>` pairs with the nearest opening tag `<t>`
before it that lies after the previous block; stray opening or closing tags are
skipped. So `<t>a<t>b</t>` holds the one block `b`, and in the MT-GRPO paper's
malformed example (`turn_level_credit_mt_grpo_mt_ppo.txt`, Table 7)
`<answer><tool>…<answer>Oscar Peterson</answer>` the answer is `Oscar Peterson`.
"""

import dataclasses
import json
import re
from typing import Any

# A tag token as a model writes it: `<name>`, `</name>`, `<name attr="...">`, `<br/>`.
# Possessive quantifiers keep the scan linear on adversarial input.
_TAG_TOKEN = re.compile(r"<(/?)([A-Za-z][\w.:-]*+)(?:\s[^<>]*+)?/?>")


def as_text(text: Any, name: str = "text") -> str:
    """Model output as a `str`: `None` (no content, e.g. a native tool call) reads as `""`.

    Args:
      text: the model output.
      name: the argument name, for the error message.

    Returns:
      `text`, or `""` for `None`.

    Raises:
      ValueError: `text` is neither a `str` nor `None` (a programming error, not
        a model error).
    """
    if text is None:
        return ""
    if isinstance(text, str):
        return text
    raise ValueError(
        f"{name} must be the model's text (str or None), got {type(text).__name__} "
        f"{text!r:.80}; pass the decoded string"
    )


def find_tag_blocks(text: str | None, tag: str) -> list[str]:
    """Raw contents of every complete `<tag>…</tag>` block, in order.

    Pairing: each `</tag>` pairs with the nearest `<tag>` before it that lies
    after the previous block's end; stray opening or closing tags are skipped.
    Contents are returned verbatim (not stripped).

    Args:
      text: model output (never raises on it).
      tag: the tag name without brackets, e.g. `"answer"`.

    Returns:
      The block contents; `[]` when there is no complete block.
    """
    text = as_text(text)
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    blocks = []
    pos = 0
    while True:
        close = text.find(close_tag, pos)
        if close < 0:
            return blocks
        start = text.rfind(open_tag, pos, close)
        if start >= 0:
            blocks.append(text[start + len(open_tag) : close])
        pos = close + len(close_tag)


def extract_tag(text: str | None, tag: str) -> str | None:
    """Content of the last complete `<tag>…</tag>` block, whitespace-stripped.

    Args:
      text: model output (never raises on it).
      tag: the tag name without brackets, e.g. `"answer"`.

    Returns:
      The stripped content, or `None` when there is no complete block.
    """
    blocks = find_tag_blocks(text, tag)
    return blocks[-1].strip() if blocks else None


def count_tag(text: str | None, tag: str) -> tuple[int, int]:
    """How many times `<tag>` and `</tag>` occur literally in `text`.

    Args:
      text: model output (never raises on it).
      tag: the tag name without brackets.

    Returns:
      `(n_open, n_close)`.
    """
    text = as_text(text)
    return text.count(f"<{tag}>"), text.count(f"</{tag}>")


@dataclasses.dataclass(frozen=True)
class TagToken:
    """One tag token in model output.

    Attributes:
      name: tag name (`"think"` for `<think>` and `</think>`).
      closing: True for `</name>`.
      start: offset of `<` in the text.
      end: offset one past `>`.
      canonical: True when written exactly `<name>` / `</name>` (no attributes,
        spaces or self-closing slash).
    """

    name: str
    closing: bool
    start: int
    end: int
    canonical: bool


def tag_tokens(text: str | None) -> list[TagToken]:
    """Every tag-like token (`<name …>`, `</name>`) in `text`, in order.

    A token needs a letter right after `<` or `</`; `a < b` and `< think>` are
    plain text, not tokens.

    Args:
      text: model output (never raises on it).

    Returns:
      The tokens.
    """
    text = as_text(text)
    tokens = []
    for match in _TAG_TOKEN.finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        expected = f"</{name}>" if closing else f"<{name}>"
        tokens.append(TagToken(name, closing, match.start(), match.end(),
                               match.group(0) == expected))
    return tokens


def parse_json(text: str | None) -> tuple[Any, str | None]:
    """`json.loads` that never raises.

    Args:
      text: JSON text (model output); `None` reads as `""` (invalid JSON).

    Returns:
      `(value, None)` on success, `(None, error message)` otherwise (invalid
      JSON, or nesting too deep for the decoder).
    """
    try:
        return json.loads(as_text(text)), None
    except (ValueError, RecursionError) as err:
        return None, f"{type(err).__name__}: {str(err)[:200]}"


@dataclasses.dataclass(frozen=True)
class ToolCallParse:
    """Everything the reward functions need to know about a step's tool-call blocks.

    Attributes:
      n_blocks: number of complete `<tool_call>…</tool_call>` blocks.
      json_ok: True iff there is at least one block and every block's content
        parses as a JSON object or a JSON array.
      items: the parsed call candidates, concatenated over blocks in order (an
        object contributes itself, an array its elements); only blocks that
        parsed contribute.
      calls: the candidates that are well-formed calls: a dict with a `str`
        `"name"` and a dict `"arguments"`.
      fields_ok: True iff `json_ok`, there is at least one candidate, and every
        candidate is a well-formed call.
      errors: one human-readable message per problem (stray tag, bad JSON,
        malformed call), in order of appearance.
    """

    n_blocks: int
    json_ok: bool
    items: list[Any]
    calls: list[dict]
    fields_ok: bool
    errors: list[str]


def _call_error(item: Any) -> str | None:
    """Why `item` is not a `{"name": str, "arguments": dict}` call, or None if it is."""
    if not isinstance(item, dict):
        return f"expected a JSON object, got {type(item).__name__}"
    if not isinstance(item.get("name"), str):
        return "missing a string 'name'"
    if not isinstance(item.get("arguments"), dict):
        return "missing a dict 'arguments'"
    return None


def parse_tool_call_blocks(text: str | None, tag: str = "tool_call") -> ToolCallParse:
    """Parse Hermes-style tool calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.

    Each block holds one call object or a JSON array of call objects (the
    PORTool prompt, `portool_rewarded_tree.txt` App. D, asks for an array);
    several blocks are concatenated in order. Never raises on model output.

    Args:
      text: one step's model output.
      tag: the block tag, `"tool_call"` for Hermes / Qwen.

    Returns:
      A `ToolCallParse`.
    """
    text = as_text(text)
    blocks = find_tag_blocks(text, tag)
    errors: list[str] = []
    n_open, n_close = count_tag(text, tag)
    if n_open != len(blocks) or n_close != len(blocks):
        errors.append(
            f"{n_open} <{tag}> and {n_close} </{tag}> tags for {len(blocks)} complete "
            "block(s): unclosed or stray tags"
        )
    items: list[Any] = []
    json_ok = bool(blocks)
    for b, block in enumerate(blocks):
        value, err = parse_json(block.strip())
        if err is not None:
            errors.append(f"block {b}: invalid JSON ({err})")
            json_ok = False
        elif isinstance(value, dict):
            items.append(value)
        elif isinstance(value, list):
            items.extend(value)
        else:
            errors.append(f"block {b}: expected a JSON object or array, got {type(value).__name__}")
            json_ok = False
    calls = []
    for i, item in enumerate(items):
        err = _call_error(item)
        if err is None:
            calls.append(item)
        else:
            errors.append(f"call {i}: {err}")
    fields_ok = json_ok and bool(items) and len(calls) == len(items)
    return ToolCallParse(len(blocks), json_ok, items, calls, fields_ok, errors)


def parse_tool_calls(text: str | None, tag: str = "tool_call") -> tuple[list[dict], list[str]]:
    """Well-formed tool calls in a step and the problems found (Hermes format).

    A call is a JSON object with a string `"name"` and a dict `"arguments"`,
    inside `<tool_call>…</tool_call>`; a block may also hold a JSON array of
    calls. Never raises on model output.

    Args:
      text: one step's model output.
      tag: the block tag, `"tool_call"` for Hermes / Qwen.

    Returns:
      `(calls, errors)`: the well-formed calls in order, and one message per
      problem (stray tag, invalid JSON, malformed call). `errors == []` means
      every block and every call parsed.
    """
    parsed = parse_tool_call_blocks(text, tag)
    return parsed.calls, parsed.errors
