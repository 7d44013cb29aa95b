"""Qwen ChatML: rendering dialogues, token-level deltas, parsing assistant output.

Rendering follows the official chat templates (the Jinja `chat_template` of
the checkpoints' tokenizer_config.json) character for character:

* `"qwen2.5"`: Qwen2.5-Instruct. A system turn always comes first (the
  default "You are Qwen, created by Alibaba Cloud. You are a helpful
  assistant." when the dialogue has none); tool schemas go into it under
  `# Tools` inside `<tools></tools>`; assistant tool calls are Hermes blocks
  `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`; consecutive tool
  results share one user turn, each in `<tool_response>\\n…\\n</tool_response>`.
  No reasoning handling: `<think>` in content is plain text.
* `"qwen3"`: Qwen3 (hybrid thinking). No default system message. An
  assistant turn after the last real user query keeps its reasoning as
  `<think>\\n…\\n</think>\\n\\n` (the last turn always shows the block, empty or
  not); earlier turns lose it. Reasoning comes from `reasoning_content` or is
  split off the content at `</think>`. `enable_thinking=False` appends the
  empty `<think>\\n\\n</think>\\n\\n` to the generation prompt.

Deliberate differences from the Jinja templates, all on inputs the templates
mishandle: `content=None` renders as `""` (Jinja prints `None`); an unknown
role raises ValueError (the templates drop the message silently).

Token-in/token-out (SPEC §1): the prompt is encoded once
(`encode_messages(..., add_generation_prompt=True)`); the policy's sampled ids
are kept verbatim; each environment insert (tool results, a user turn) is
encoded alone by `render_delta` and appended. The history is never
re-tokenised, so `previous_ids + delta` are the ids the policy saw.
"""

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl.models.tokenizer import ENDOFTEXT, IM_END, IM_START, Tokenizer
from agentrl.rewards.parsing import as_text, parse_tool_calls

__all__ = [
    "FLAVOURS",
    "QWEN25_DEFAULT_SYSTEM",
    "ParsedAssistant",
    "chat_flavour",
    "encode_messages",
    "parse_assistant",
    "parse_tool_calls",
    "render_delta",
    "render_delta_text",
    "render_messages",
]

FLAVOURS = ("qwen2.5", "qwen3")
ROLES = ("system", "user", "assistant", "tool")
ENVIRONMENT_ROLES = ("system", "user", "tool")
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
NEWLINE = "\n"


def _check_flavour(flavour: str) -> str:
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    return flavour


def chat_flavour(tokenizer: Tokenizer) -> str:
    """The chat flavour that goes with a tokenizer.

    A bundled tokenizer's name is its flavour; a checkpoint's tokenizer is
    `"qwen3"` when `<think>` is one of its added tokens, else `"qwen2.5"`.
    """
    if tokenizer.name in FLAVOURS:
        return tokenizer.name
    return "qwen3" if "<think>" in tokenizer.special_tokens else "qwen2.5"


def _content(message: Mapping[str, Any]) -> str:
    """A message's text: `content` as given, `""` when absent or None."""
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ValueError(
            f"{message.get('role')} message content must be a str or None, got "
            f"{type(content).__name__}"
        )
    return content


def _check_messages(messages: Sequence[Mapping[str, Any]], roles=ROLES) -> None:
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in roles:
            got = message.get("role") if isinstance(message, Mapping) else message
            raise ValueError(f"message {index}: role must be one of {roles}, got {got!r}")
        _content(message)


def _json(value: Any) -> str:
    """Jinja's `tojson` as transformers defines it: `json.dumps(value, ensure_ascii=False)`."""
    return json.dumps(value, ensure_ascii=False)


def _tool_call_text(call: Mapping[str, Any], flavour: str) -> str:
    """One Hermes tool-call block; `call` is `{"name", "arguments"}` or OpenAI's `{"function": …}`.

    Arguments should be a dict. A JSON string is inserted verbatim by Qwen3
    and JSON-quoted by Qwen2.5 (as their templates do).
    """
    function = call.get("function") or call
    if not isinstance(function.get("name"), str) or "arguments" not in function:
        raise ValueError(f"a tool call needs a str 'name' and 'arguments', got {call!r:.200}")
    arguments = function["arguments"]
    if not (flavour == "qwen3" and isinstance(arguments, str)):
        arguments = _json(arguments)
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'


def _assistant_qwen25(message: Mapping[str, Any]) -> str:
    content, calls = _content(message), message.get("tool_calls")
    if not calls:
        return f"{IM_START}assistant\n{content}{IM_END}\n"
    text = f"{IM_START}assistant" + (f"\n{content}" if content else "")
    text += "".join("\n" + _tool_call_text(call, "qwen2.5") for call in calls)
    return text + f"{IM_END}\n"


def _split_reasoning(message: Mapping[str, Any]) -> tuple[str, str]:
    """Qwen3's `(reasoning, content)`: `reasoning_content`, or the content split at `</think>`."""
    content, reasoning = _content(message), message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")


def _assistant_qwen3(message: Mapping[str, Any], after_last_query: bool, is_last: bool) -> str:
    reasoning, content = _split_reasoning(message)
    if after_last_query and (is_last or reasoning):
        shown = f"<think>\n{reasoning.strip(NEWLINE)}\n</think>\n\n{content.lstrip(NEWLINE)}"
        text = f"{IM_START}assistant\n{shown}"
    else:
        text = f"{IM_START}assistant\n{content}"
    for index, call in enumerate(message.get("tool_calls") or ()):
        text += ("\n" if index or content else "") + _tool_call_text(call, "qwen3")
    return text + f"{IM_END}\n"


def _environment_turn(message: Mapping[str, Any], prev_role: str | None,
                      next_role: str | None) -> str:
    """A system, user or tool message; tool results group into one user turn."""
    role, content = message["role"], _content(message)
    if role != "tool":
        return f"{IM_START}{role}\n{content}{IM_END}\n"
    head = f"{IM_START}user" if prev_role != "tool" else ""
    tail = f"{IM_END}\n" if next_role != "tool" else ""
    return f"{head}\n<tool_response>\n{content}\n</tool_response>{tail}"


def _system_header(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None,
                   flavour: str) -> str:
    """The opening system turn: the first message if it is a system one, plus the tools."""
    system = messages[0] if messages and messages[0]["role"] == "system" else None
    if tools:
        if system is not None:
            prefix = _content(system) + "\n\n"
        else:
            prefix = QWEN25_DEFAULT_SYSTEM + "\n\n" if flavour == "qwen2.5" else ""
        schemas = "".join("\n" + _json(tool) for tool in tools)
        return f"{IM_START}system\n{prefix}{TOOLS_PREAMBLE}{schemas}{TOOLS_POSTAMBLE}{IM_END}\n"
    if system is not None:
        return f"{IM_START}system\n{_content(system)}{IM_END}\n"
    return f"{IM_START}system\n{QWEN25_DEFAULT_SYSTEM}{IM_END}\n" if flavour == "qwen2.5" else ""


def _last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Qwen3: index of the last user message that is not a wrapped tool response."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        content = message.get("content")
        if message["role"] == "user" and isinstance(content, str) and not (
            content.startswith("<tool_response>") and content.endswith("</tool_response>")
        ):
            return index
    return len(messages) - 1


def _generation_prompt(flavour: str, enable_thinking: bool) -> str:
    thinking_off = flavour == "qwen3" and enable_thinking is False
    return f"{IM_START}assistant\n" + (EMPTY_THINK if thinking_off else "")


def render_messages(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = False, flavour: str = "qwen2.5",
                    enable_thinking: bool = True) -> str:
    """A dialogue as Qwen's chat template renders it.

    Args:
      messages: dicts with `role` (`system`, `user`, `assistant`, `tool`) and
        `content` (str or None); assistant messages may carry `tool_calls`
        (`[{"name": str, "arguments": dict}]` or OpenAI's
        `[{"type": "function", "function": {...}}]`) and, for Qwen3,
        `reasoning_content`. A leading system message becomes the system turn.
      tools: tool schemas (JSON-serialisable, e.g. OpenAI
        `{"type": "function", "function": {...}}`), rendered one JSON per line.
      add_generation_prompt: end with the opening of an assistant turn.
      flavour: `"qwen2.5"` or `"qwen3"`.
      enable_thinking: Qwen3 only; False appends the empty think block to the
        generation prompt (the template's non-thinking mode).

    Returns:
      The rendered text (control tokens as text: `<|im_start|>` …).

    Raises:
      ValueError: unknown flavour or role, non-str content, malformed tool call.
    """
    _check_flavour(flavour)
    _check_messages(messages)
    text = _system_header(messages, tools, flavour)
    last_query = _last_query_index(messages)
    roles = [m["role"] for m in messages]
    for index, message in enumerate(messages):
        prev_role = roles[index - 1] if index else None
        next_role = roles[index + 1] if index + 1 < len(roles) else None
        if index == 0 and message["role"] == "system":
            continue
        if message["role"] != "assistant":
            text += _environment_turn(message, prev_role, next_role)
        elif flavour == "qwen3":
            text += _assistant_qwen3(message, index > last_query, next_role is None)
        else:
            text += _assistant_qwen25(message)
    if add_generation_prompt:
        text += _generation_prompt(flavour, enable_thinking)
    return text


def encode_messages(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Any] | None = None, add_generation_prompt: bool = False,
                    flavour: str | None = None, enable_thinking: bool = True) -> list[int]:
    """Token ids of `render_messages(...)` (the prompt of a rollout).

    Args:
      tokenizer: from `get_tokenizer`.
      messages, tools, add_generation_prompt, enable_thinking: as `render_messages`.
      flavour: default `chat_flavour(tokenizer)`.

    Returns:
      `tokenizer.encode(render_messages(...))`.
    """
    flavour = chat_flavour(tokenizer) if flavour is None else flavour
    return tokenizer.encode(render_messages(
        messages, tools=tools, add_generation_prompt=add_generation_prompt,
        flavour=flavour, enable_thinking=enable_thinking))


def render_delta_text(new_messages: Sequence[Mapping[str, Any]], *, flavour: str = "qwen2.5",
                      add_generation_prompt: bool = True, enable_thinking: bool = True,
                      close_turn: bool = False) -> str:
    """The text the chat template puts after an assistant turn's `<|im_end|>`.

    For tool results after an assistant generation:
    `"\\n<|im_start|>user\\n<tool_response>\\n…\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"`.

    Args:
      new_messages: the environment's messages (`tool`, `user`, `system`)
        that follow the assistant turn, in order.
      flavour, enable_thinking: as `render_messages`.
      add_generation_prompt: end with the opening of the next assistant turn.
      close_turn: the generation stopped without `<|im_end|>` (length cut):
        start the delta with it, as the template would have closed the turn.

    Raises:
      ValueError: an assistant (or unknown) role in `new_messages`: assistant
        turns are the policy's own sampled tokens, never a delta.
    """
    _check_flavour(flavour)
    _check_messages(new_messages, ENVIRONMENT_ROLES)
    text = (IM_END if close_turn else "") + "\n"
    roles = ["assistant", *(m["role"] for m in new_messages), None]
    for index, message in enumerate(new_messages):
        text += _environment_turn(message, roles[index], roles[index + 2])
    if add_generation_prompt:
        text += _generation_prompt(flavour, enable_thinking)
    return text


def render_delta(tokenizer: Tokenizer, new_messages: Sequence[Mapping[str, Any]], *,
                 flavour: str | None = None, add_generation_prompt: bool = True,
                 enable_thinking: bool = True, close_turn: bool = False) -> list[int]:
    """Token ids of an environment insert, to append to a rollout's ids (SPEC §1).

    Only `new_messages` are encoded: the history is never re-tokenised. The
    delta starts right after a token that ends a segment (`<|im_end|>`), so
    `previous_ids + delta == encode(render(all messages))` whenever the history
    itself renders to `previous_ids` (the policy's tokens are the canonical
    tokenisation of its text and the template does not rewrite past turns;
    Qwen3's does: it drops the reasoning of turns before the last user query).

    Args:
      tokenizer: from `get_tokenizer`.
      new_messages, add_generation_prompt, enable_thinking, close_turn: as
        `render_delta_text`.
      flavour: default `chat_flavour(tokenizer)`.

    Returns:
      The delta's ids.
    """
    flavour = chat_flavour(tokenizer) if flavour is None else flavour
    return tokenizer.encode(render_delta_text(
        new_messages, flavour=flavour, add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking, close_turn=close_turn))


@dataclasses.dataclass(frozen=True)
class ParsedAssistant:
    """One assistant generation split into its parts.

    Attributes:
      content: the text outside the think block and the complete tool-call
        blocks, whitespace-stripped.
      reasoning: the think block's text (newline-stripped, as Qwen3's template
        reads it); None when the text has no think tags.
      tool_calls: well-formed calls `{"name": str, "arguments": dict}` in
        order (`agentrl.rewards.parsing.parse_tool_calls`).
      errors: one message per problem (think tags, stray tool-call tags,
        invalid JSON, malformed calls); `[]` when everything parsed.
    """

    content: str
    reasoning: str | None
    tool_calls: list[dict]
    errors: list[str]

    def to_message(self) -> dict[str, Any]:
        """The assistant message for `render_messages` (reasoning as `reasoning_content`)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return message


def _split_think(text: str) -> tuple[str | None, str, list[str]]:
    """`(reasoning, rest, errors)`, reading `</think>` as Qwen3's template does."""
    n_open, n_close = text.count("<think>"), text.count("</think>")
    errors = []
    if n_open > 1 or n_close > 1:
        errors.append(f"{n_open} <think> and {n_close} </think> tags: reasoning is the text "
                      "before the first </think>, content the text after the last")
    if n_close:
        head, rest = text.split("</think>", 1)[0], text.rsplit("</think>", 1)[-1]
        if "<think>" in rest and n_open == 1:
            errors.append("<think> after </think>")
        return head.split("<think>")[-1].strip("\n"), rest, errors
    if n_open:
        head, reasoning = text.split("<think>", 1)
        errors.append("unclosed <think>: the generation stopped inside its reasoning")
        return reasoning.split("<think>")[-1].strip("\n"), head, errors
    return None, text, errors


def _without_blocks(text: str, tag: str) -> str:
    """`text` minus the complete `<tag>…</tag>` blocks that `find_tag_blocks` pairs."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    pieces, pos, keep_from = [], 0, 0
    while (close := text.find(close_tag, pos)) >= 0:
        start = text.rfind(open_tag, pos, close)
        if start >= 0:
            pieces.append(text[keep_from:start])
            keep_from = close + len(close_tag)
        pos = close + len(close_tag)
    return "".join(pieces) + text[keep_from:]


def parse_assistant(text: str | None) -> ParsedAssistant:
    """Split an assistant generation into content, reasoning and tool calls; never raises.

    Reading (Qwen3's template, `agentrl.rewards.parsing`'s pairing rule):
    trailing `<|im_end|>` / `<|endoftext|>` are dropped; the reasoning is the
    text before the first `</think>` after its last `<think>` (a missing
    `<think>` is fine: Qwen3 thinking models get it in the prompt), the rest
    is after the last `</think>`; without `</think>`, an unclosed `<think>`
    starts the reasoning. Tool calls are read from the rest only (a
    `<tool_call>` inside the reasoning is thought, not action).

    Args:
      text: the decoded generation (None reads as "").

    Returns:
      A `ParsedAssistant`; `parse_assistant(render of a turn)` gives the
      turn's content, reasoning and calls back.
    """
    text = as_text(text)
    while text.endswith((IM_END, ENDOFTEXT)):
        text = text.removesuffix(IM_END).removesuffix(ENDOFTEXT)
    reasoning, rest, errors = _split_think(text)
    calls, call_errors = parse_tool_calls(rest)
    content = _without_blocks(rest, "tool_call").strip()
    return ParsedAssistant(content, reasoning, calls, errors + call_errors)
