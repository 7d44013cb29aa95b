"""CM2's hybrid tool simulator (SPEC §5.6; `cm2_checklist_rewards.txt` §4.3, App. A.1.5).

CM2's dialogues are synthetic: their tools do not exist. A call the policy
makes is answered in two ways:

1. **Replay.** If (tool name, canonical JSON arguments) equals a call recorded
   in the reference dialogue, the recorded response is returned.
2. **Simulation.** Otherwise an LLM is prompted with the App. A.1.5 prompt: the
   tool's JSON schema, the dialogue's recorded I/O of that tool as few-shot
   examples, and the new arguments. It must reply
   `{"analysis": ..., "execution_result": ...}`; `execution_result` is the
   tool output. Unparseable replies are retried; after the retries (or when
   the server fails) the policy gets a tool error, never an exception.

Canonical arguments (`canonical_arguments`): JSON with sorted keys, no
whitespace, integral floats written as integers (`2.0` → `2`), booleans kept
as booleans. A JSON-string `arguments` field is decoded first.

`HybridToolSimulator` has the `ToolRegistry` call interface (`schemas`,
`call`, `call_many`), so an agent loop uses either.
"""

import concurrent.futures
import dataclasses
import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl.envs.chat_client import ChatClientError, ChatModel, parse_json_reply
from agentrl.envs.tools import ToolResult, normalize_call, truncate_middle
from agentrl.rewards.parsing import parse_json

__all__ = [
    "SIMULATOR_SYSTEM_PROMPT",
    "SIMULATOR_USER_TEMPLATE",
    "HybridToolSimulator",
    "SimulatorStats",
    "ToolRecord",
    "canonical_arguments",
    "records_from_messages",
    "simulator_messages",
]

# `cm2_checklist_rewards.txt` App. A.1.5, "SYSTEM PROMPT", verbatim (PDF line wraps undone).
SIMULATOR_SYSTEM_PROMPT = """\
You are a precise tool executor that learns from examples.
You will be given:
- Tool call JSON Schema
- Few-shot examples showing tool calls and their execution results
- A new tool call with specific arguments

Your task:
1) Learn the OUTPUT FORMAT from the provided examples - follow the exact structure, data types, \
and response patterns
2) Ensure FACTUAL CONSISTENCY - your output should align with the factual information \
demonstrated in the examples
3) For the new tool call:
   - Apply the learned format to the new arguments
   - Maintain factual consistency with example patterns
   - If arguments are similar to examples, adapt the example results appropriately
   - If arguments are significantly different, generate new results following the learned \
format and factual patterns
   - May need to fix some type or error in the examples
4) Handle errors gracefully - if arguments are invalid or missing, return error messages in the \
same format as examples

Critical constraints:
- Act as a silent function executor - NO explanations, suggestions, or hints
- NO guidance on how to fix errors or improve calls
- NO references to examples or comparisons
- Return ONLY the raw execution result as valid JSON
- For errors, return minimal error information without instructional content

Output requirements:
- First do some analysis on how to mock the execution results. Then return ONLY the execution \
result as valid JSON array or object
- No explanations, markdown, or code fences
- Follow the exact output structure learned from examples
- Maintain factual consistency with the example patterns

Format:
{
 "analysis": str,
 "execution_result": JSON array or object,
}"""

# App. A.1.5, "USER PROMPT": `{"\n".join(examples_lines)}` followed by this block.
SIMULATOR_USER_TEMPLATE = """\
{examples}

Current tool name: {tool_name}
Current tool input schema (JSON Schema):
{schema_str}
Current arguments (JSON):
{parameters}
Generate tool execution result in JSON format."""

# The paper does not print `examples_lines`; this is our rendering of one recorded call.
EXAMPLE_TEMPLATE = """\
Example {index}:
Tool name: {tool_name}
Arguments (JSON): {arguments}
Execution result: {response}"""


def _normalize(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(key): _normalize(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_normalize(item) for item in value]
    return value


def canonical_arguments(arguments: Any) -> str:
    """Canonical JSON text of tool-call arguments, the replay key.

    Sorted keys, compact separators, integral floats as integers, unicode
    kept. A `str` is decoded as JSON first (an undecodable string is its own
    key, stripped).
    """
    if isinstance(arguments, str) and not arguments.strip():
        arguments = None
    if isinstance(arguments, str):
        decoded, err = parse_json(arguments)
        if err is not None:
            return arguments.strip()
        arguments = decoded
    if arguments is None:
        arguments = {}
    return json.dumps(_normalize(arguments), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class ToolRecord:
    """One recorded tool call of a reference dialogue and its response."""

    name: str
    arguments: Any
    response: str

    @property
    def key(self) -> tuple[str, str]:
        return self.name, canonical_arguments(self.arguments)


def _tool_name(schema: Mapping[str, Any]) -> str:
    function = schema.get("function") if isinstance(schema.get("function"), Mapping) else schema
    name = function.get("name")
    if not isinstance(name, str):
        raise ValueError(f"a tool schema needs a str 'name' (or 'function.name'), got "
                         f"{json.dumps(schema)[:200]}")
    return name


def _parameters(schema: Mapping[str, Any]) -> Any:
    function = schema.get("function") if isinstance(schema.get("function"), Mapping) else schema
    return function.get("parameters", {})


def _text(content: Any) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def records_from_messages(messages: Sequence[Mapping[str, Any]]) -> list[ToolRecord]:
    """Recorded tool I/O of a dialogue in the OpenAI message format.

    Assistant messages carry `tool_calls` (`[{"id", "function": {"name",
    "arguments"}}]`, arguments a dict or JSON text); each following `tool`
    message answers the call whose `id` equals its `tool_call_id`, or, when
    ids are absent, the calls of the preceding assistant message in order.
    Calls without a response are skipped.
    """
    records: list[ToolRecord] = []
    pending: list[tuple[str | None, str, Any]] = []  # (call id, name, arguments), unanswered
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            pending = []
            for call in message.get("tool_calls") or ():
                call_id = call.get("id") if isinstance(call, Mapping) else None
                pending.append((str(call_id) if call_id else None, *normalize_call(call)))
        elif role == "tool" and pending:
            call_id = message.get("tool_call_id")
            index = next((i for i, (pending_id, _, _) in enumerate(pending)
                          if call_id is not None and pending_id == str(call_id)), 0)
            _, name, arguments = pending.pop(index)
            records.append(ToolRecord(name, arguments, _text(message.get("content"))))
    return records


def simulator_messages(schema: Mapping[str, Any], records: Sequence[ToolRecord], name: str,
                       arguments: Any) -> list[dict]:
    """The App. A.1.5 chat messages for one simulated call.

    The schema shown is the tool's input JSON schema (its `parameters`), as
    the paper's "Current tool input schema (JSON Schema)" says.

    Args:
      schema: the tool's schema (function format or bare `{name, ...}`).
      records: few-shot examples: recorded calls of this tool.
      name: the tool name.
      arguments: the call's decoded arguments.
    """
    examples = [
        EXAMPLE_TEMPLATE.format(index=index + 1, tool_name=record.name,
                                arguments=json.dumps(record.arguments, ensure_ascii=False),
                                response=record.response)
        for index, record in enumerate(records)
    ]
    user = SIMULATOR_USER_TEMPLATE.format(
        examples="\n".join(examples) if examples else "(no examples recorded for this tool)",
        tool_name=name, schema_str=json.dumps(_parameters(schema), ensure_ascii=False, indent=2),
        parameters=json.dumps(arguments, ensure_ascii=False))
    return [{"role": "system", "content": SIMULATOR_SYSTEM_PROMPT},
            {"role": "user", "content": user}]


@dataclasses.dataclass
class SimulatorStats:
    """How calls were answered.

    Attributes:
      replayed: exact matches answered from the recording.
      simulated: answered by the LLM.
      failed: the LLM's replies never parsed or the server failed (tool error).
      rejected: unknown tool or arguments that are not a JSON object (tool error,
        no LLM request).
      requests: LLM requests made.
      parse_failures: LLM replies without a usable `execution_result`.
    """

    replayed: int = 0
    simulated: int = 0
    failed: int = 0
    rejected: int = 0
    requests: int = 0
    parse_failures: int = 0

    def as_dict(self, prefix: str = "simulator/") -> dict[str, int]:
        return {prefix + key: value for key, value in dataclasses.asdict(self).items()}


class HybridToolSimulator:
    """Replay recorded tool I/O, simulate the rest with an LLM (CM2 §4.3).

    Args:
      client: the simulator LLM (`ChatClient` or any `ChatModel`).
      tools: schemas of the dialogue's tools (function format
        `{"type": "function", "function": {...}}` or bare `{name, ...}`).
      records: the dialogue's recorded tool I/O (see `records_from_messages`).
      max_retries: extra LLM requests after an unparseable reply.
      temperature: sampling temperature of the first request.
      retry_temperature: temperature of the retries (a greedy server would
        repeat the same unparseable reply).
      max_tokens: completion budget of a request.
      max_examples: few-shot examples per request (the first recorded ones).
      max_output_chars: outputs longer than this lose their middle.

    Replay is stateless: a key recorded several times always returns its first
    recorded response.
    """

    def __init__(self, client: ChatModel, tools: Sequence[Mapping[str, Any]],
                 records: Sequence[ToolRecord] = (), *, max_retries: int = 2,
                 temperature: float = 0.0, retry_temperature: float = 1.0,
                 max_tokens: int = 2048, max_examples: int = 8,
                 max_output_chars: int = 10_000):
        if max_retries < 0 or max_examples < 0:
            raise ValueError(f"max_retries={max_retries} and max_examples={max_examples} "
                             "must be >= 0")
        self.client = client
        self._schemas = {_tool_name(schema): dict(schema) for schema in tools}
        self._replay: dict[tuple[str, str], str] = {}
        self._examples: dict[str, list[ToolRecord]] = {}
        for record in records:
            self._replay.setdefault(record.key, record.response)
            self._examples.setdefault(record.name, []).append(record)
        self.max_retries = max_retries
        self.temperature = temperature
        self.retry_temperature = retry_temperature
        self.max_tokens = max_tokens
        self.max_examples = max_examples
        self.max_output_chars = max_output_chars
        self._lock = threading.Lock()
        self._stats = SimulatorStats()

    @classmethod
    def from_dialogue(cls, client: ChatModel, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]], **options: Any) -> "HybridToolSimulator":
        """A simulator over one reference dialogue's tools and recorded tool I/O."""
        return cls(client, tools, records_from_messages(messages), **options)

    @property
    def stats(self) -> SimulatorStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def schemas(self) -> list[dict]:
        """The tools in function format (what the policy's system prompt lists)."""
        return [schema if "function" in schema else {"type": "function", "function": schema}
                for schema in self._schemas.values()]

    def _count(self, field: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + amount)

    def call(self, name: str, arguments: Mapping[str, Any] | str | None = None) -> ToolResult:
        """Answer one call: replay, simulate, or a tool error. Never raises."""
        start = time.perf_counter()
        if name not in self._schemas:
            self._count("rejected")
            available = ", ".join(sorted(self._schemas)) or "none"
            return ToolResult.failure(f"unknown tool '{name}'. Available tools: {available}.",
                                      name=str(name), latency_s=time.perf_counter() - start)
        decoded = {} if arguments is None or arguments == "" else arguments
        if isinstance(decoded, str):
            decoded, err = parse_json(decoded)
            if err is not None:
                decoded = None
        if not isinstance(decoded, Mapping):
            self._count("rejected")
            return ToolResult.failure(f"arguments of tool '{name}' must be a JSON object.",
                                      name=name, latency_s=time.perf_counter() - start)
        recorded = self._replay.get((name, canonical_arguments(decoded)))
        if recorded is not None:
            self._count("replayed")
            return self._success(recorded, name, start)
        output = self._simulate(name, dict(decoded))
        if output is None:
            self._count("failed")
            return ToolResult.failure(f"tool '{name}' is unavailable: the tool simulator gave no "
                                      "valid result.", name=name,
                                      latency_s=time.perf_counter() - start)
        self._count("simulated")
        return self._success(output, name, start)

    def call_many(self, calls: Sequence[Any], max_workers: int = 8) -> list[ToolResult]:
        """Answer calls in parallel; results in the order of `calls`."""
        pairs = [normalize_call(call) for call in calls]
        if len(pairs) <= 1 or max_workers <= 1:
            return [self.call(name, arguments) for name, arguments in pairs]
        with concurrent.futures.ThreadPoolExecutor(min(max_workers, len(pairs))) as pool:
            return list(pool.map(lambda pair: self.call(*pair), pairs))

    def _success(self, output: str, name: str, start: float) -> ToolResult:
        content = truncate_middle(output, self.max_output_chars)
        return ToolResult(content, True, None, time.perf_counter() - start, name)

    def _simulate(self, name: str, arguments: dict) -> str | None:
        """The LLM's `execution_result` as text, or None after the retries."""
        examples = self._examples.get(name, [])[: self.max_examples]
        messages = simulator_messages(self._schemas[name], examples, name, arguments)
        for attempt in range(self.max_retries + 1):
            temperature = self.temperature if attempt == 0 else self.retry_temperature
            self._count("requests")
            try:
                reply = self.client.chat(messages, temperature=temperature,
                                         max_tokens=self.max_tokens)[0]
            except ChatClientError:
                return None  # the client already retried the transport
            value, _ = parse_json_reply(reply)
            if isinstance(value, dict) and "execution_result" in value:
                result = value["execution_result"]
                return result if isinstance(result, str) else json.dumps(result,
                                                                           ensure_ascii=False)
            self._count("parse_failures")
        return None
