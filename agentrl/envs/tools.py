"""Tools the policy calls: a registry with JSON-schema validation, and built-in tools.

A `Tool` is a name, a description, a JSON schema of its arguments and a Python
function. A `ToolRegistry` holds tools, renders their schemas in the
OpenAI / Qwen function format (the `tools` list of `agentrl.models.chat`), and
executes calls. Execution never raises: every problem (unknown tool, invalid
JSON, an argument missing, extra or of the wrong type, an exception inside the
tool, a timeout) comes back as a `ToolResult` with `ok=False` and a message
written for the policy, which sees it as the tool's output:

    Error: unknown tool 'serach'. Available tools: calculator, response_gen, search.
    Error: invalid arguments for tool 'search': missing required argument 'query' (string).
    Error: tool 'calculator' failed: division by zero.

Built-in tools: `calculator_tool` (safe AST arithmetic), `response_gen_tool`
(PORTool's final-answer tool, `portool_rewarded_tree.txt` App. D) and
`python_tool` (the sandbox, `agentrl.envs.sandbox`).
"""

import ast
import concurrent.futures
import dataclasses
import json
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from agentrl.rewards.parsing import parse_json

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "DEFAULT_TIMEOUT_S",
    "Tool",
    "ToolError",
    "ToolExecutor",
    "ToolRegistry",
    "ToolResult",
    "calculator_tool",
    "evaluate_expression",
    "normalize_call",
    "python_tool",
    "response_gen_tool",
    "truncate_middle",
    "validate_arguments",
]

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_OUTPUT_CHARS = 10_000

# JSON Schema keywords that are enforced, and annotations that are accepted and ignored.
VALIDATED_KEYWORDS = frozenset({
    "type", "properties", "required", "enum", "const", "additionalProperties", "items",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
    "minItems", "maxItems", "pattern", "anyOf",
})
ANNOTATION_KEYWORDS = frozenset({
    "description", "title", "default", "examples", "format", "$schema", "$comment",
    "deprecated", "readOnly", "writeOnly", "nullable",
})
JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")


class ToolError(Exception):
    """Raised by a tool for an error the policy caused; the message alone goes back to it."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call, as the policy sees it.

    Attributes:
      content: the text inserted as the tool's response (the error message when
        `ok` is False), truncated to the registry's `max_output_chars`.
      ok: True iff the tool ran and returned.
      error: the error message (without the `Error: ` prefix) when `ok` is False.
      latency_s: wall-clock seconds of the call, validation included.
      name: the called tool's name as the policy wrote it.
      final: True iff a final-answer tool (e.g. `response_gen`) ran successfully.
    """

    content: str
    ok: bool
    error: str | None = None
    latency_s: float = 0.0
    name: str = ""
    final: bool = False

    @classmethod
    def failure(cls, message: str, *, name: str = "", latency_s: float = 0.0) -> "ToolResult":
        return cls(f"Error: {message}", False, message, latency_s, name)


class ToolExecutor(Protocol):
    """What an agent loop needs to run tool calls: `ToolRegistry` and the CM2 simulator."""

    def schemas(self) -> list[dict]: ...

    def call(self, name: str, arguments: Mapping[str, Any] | str | None) -> ToolResult: ...

    def call_many(self, calls: Sequence[Any], max_workers: int = 8) -> list[ToolResult]: ...


# ---------------------------------------------------------------------------------------------
# JSON-schema subset
# ---------------------------------------------------------------------------------------------


def _json_type(value: Any) -> str:
    """The JSON type name of a Python value (`bool` is boolean, not integer)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _is_type(value: Any, expected: str) -> bool:
    actual = _json_type(value)
    if expected == "number":
        return actual in ("integer", "number")
    if expected == "integer":
        return actual == "integer" or (actual == "number" and float(value).is_integer())
    return actual == expected


def _show(value: Any) -> str:
    """A short rendering of a value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _got(value: Any) -> str:
    return f"{_json_type(value)} {_show(value)}"


def _type_label(schema: Mapping[str, Any]) -> str:
    expected = schema.get("type")
    if isinstance(expected, list):
        return " or ".join(expected)
    if expected is not None:
        return str(expected)
    if "enum" in schema:
        return "one of " + _show(list(schema["enum"]))
    return "any"


def _validate_number(value: Any, schema: Mapping[str, Any], where: str) -> list[str]:
    errors = []
    bounds = (("minimum", operator.ge, ">="), ("maximum", operator.le, "<="),
              ("exclusiveMinimum", operator.gt, ">"), ("exclusiveMaximum", operator.lt, "<"))
    for keyword, holds, symbol in bounds:
        bound = schema.get(keyword)
        numeric = isinstance(bound, int | float) and not isinstance(bound, bool)
        if numeric and not holds(value, bound):
            errors.append(f"{where} must be {symbol} {_show(bound)}, got {_show(value)}")
    return errors


def _validate_string(value: str, schema: Mapping[str, Any], where: str) -> list[str]:
    errors = []
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(f"{where} must have at least {schema['minLength']} characters, "
                      f"got {len(value)}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{where} must have at most {schema['maxLength']} characters, "
                      f"got {len(value)}")
    if "pattern" in schema and re.search(schema["pattern"], value) is None:
        errors.append(f"{where} must match the pattern {_show(schema['pattern'])}, "
                      f"got {_show(value)}")
    return errors


def _validate_array(value: Sequence[Any], schema: Mapping[str, Any], where: str,
                    path: str) -> list[str]:
    errors = []
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{where} must have at least {schema['minItems']} items, got {len(value)}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{where} must have at most {schema['maxItems']} items, got {len(value)}")
    items = schema.get("items")
    if isinstance(items, Mapping):
        for index, item in enumerate(value):
            errors.extend(_validate(item, items, f"{path}[{index}]"))
    return errors


def _validate_object(value: Mapping[str, Any], schema: Mapping[str, Any], path: str) -> list[str]:
    errors = []
    properties = schema.get("properties") or {}
    prefix = f"{path}." if path else ""
    for name in schema.get("required") or ():
        if name not in value:
            label = _type_label(properties.get(name) or {})
            errors.append(f"missing required argument '{prefix}{name}' ({label})")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in properties:
            errors.extend(_validate(item, properties[name], f"{prefix}{name}"))
        elif extra is False:
            allowed = ", ".join(properties) or "none"
            errors.append(f"unexpected argument '{prefix}{name}'; expected arguments: {allowed}")
        elif isinstance(extra, Mapping):
            errors.extend(_validate(item, extra, f"{prefix}{name}"))
    return errors


def _validate(value: Any, schema: Mapping[str, Any], path: str) -> list[str]:
    """Error messages for `value` against `schema`; `path` names the argument (`a.b[2]`)."""
    where = f"argument '{path}'" if path else "arguments"
    options = schema.get("anyOf")
    if options and all(_validate(value, option, path) for option in options):
        labels = " or ".join(_type_label(option) for option in options)
        return [f"{where} must be {labels}, got {_got(value)}"]
    expected = schema.get("type")
    if expected is not None:
        options = expected if isinstance(expected, list) else [expected]
        if not any(_is_type(value, option) for option in options):
            return [f"{where} must be {_type_label(schema)}, got {_got(value)}"]
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        return [f"{where} must be one of {_show(list(schema['enum']))}, got {_show(value)}"]
    if "const" in schema and not _same(value, schema["const"]):
        return [f"{where} must be {_show(schema['const'])}, got {_show(value)}"]
    kind = _json_type(value)
    if kind in ("integer", "number"):
        return _validate_number(value, schema, where)
    if kind == "string":
        return _validate_string(value, schema, where)
    if kind == "array":
        return _validate_array(value, schema, where, path)
    if kind == "object":
        return _validate_object(value, schema, path)
    return []


def _same(a: Any, b: Any) -> bool:
    """JSON equality: `1 == 1.0`, but `True != 1`."""
    numeric = ("integer", "number")
    same_kind = _json_type(a) == _json_type(b) or (
        _json_type(a) in numeric and _json_type(b) in numeric)
    return same_kind and a == b


def validate_arguments(arguments: Any, schema: Mapping[str, Any]) -> list[str]:
    """Check tool-call arguments against a JSON schema (the subset in `VALIDATED_KEYWORDS`).

    Args:
      arguments: the decoded arguments (a dict for a well-formed call).
      schema: the tool's `parameters` schema.

    Returns:
      One message per problem, naming the argument (dotted path, `[i]` for
      array items) and what was expected; `[]` when the arguments are valid.
    """
    return _validate(arguments, schema, "")


def check_schema(schema: Any, path: str = "parameters") -> None:
    """Raise ValueError if `schema` uses a keyword this validator would silently skip."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"{path} must be a JSON schema object (dict), got {type(schema).__name__}")
    unknown = set(schema) - VALIDATED_KEYWORDS - ANNOTATION_KEYWORDS
    if unknown:
        raise ValueError(
            f"{path} uses unsupported JSON-schema keyword(s) {sorted(unknown)}; supported: "
            f"{sorted(VALIDATED_KEYWORDS)} (annotations {sorted(ANNOTATION_KEYWORDS)} are "
            "ignored); rewrite the schema with these"
        )
    types = schema.get("type")
    for kind in types if isinstance(types, list) else [types] if types is not None else []:
        if kind not in JSON_TYPES:
            raise ValueError(f"{path}.type={kind!r} is not a JSON type; use one of {JSON_TYPES}")
    for name, sub in (schema.get("properties") or {}).items():
        check_schema(sub, f"{path}.properties.{name}")
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), Mapping):
            check_schema(schema[keyword], f"{path}.{keyword}")
    for index, sub in enumerate(schema.get("anyOf") or ()):
        check_schema(sub, f"{path}.anyOf[{index}]")
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except re.error as err:
            raise ValueError(
                f"{path}.pattern={schema['pattern']!r} is not a regex: {err}") from None


# ---------------------------------------------------------------------------------------------
# Tool and registry
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable tool.

    Attributes:
      name: the function name the policy writes in its call.
      description: what the tool does, shown to the policy.
      parameters: JSON schema of the arguments (`{"type": "object", ...}`).
      fn: called as `fn(**arguments)`; returns a `str` (used verbatim) or any
        JSON-serialisable value (sent as JSON). Raise `ToolError` for an error
        the policy caused; any other exception is reported by type and message.
      timeout_s: per-call limit overriding the registry's (None: the registry's).
      max_output_chars: output limit overriding the registry's.
      final: a successful call ends the trajectory (PORTool's `response_gen`).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any]
    timeout_s: float | None = None
    max_output_chars: int | None = None
    final: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][\w.-]{0,63}", self.name):
            raise ValueError(
                f"Tool name {self.name!r} must be 1-64 characters of letters, digits, '_', '.' "
                "or '-', starting with a letter or '_'"
            )
        check_schema(self.parameters, f"Tool {self.name!r} parameters")
        if self.parameters.get("type") != "object":
            raise ValueError(
                f"Tool {self.name!r} parameters must have \"type\": \"object\" (function-calling "
                f"format), got type={self.parameters.get('type')!r}"
            )
        if not callable(self.fn):
            raise ValueError(
                f"Tool {self.name!r} fn must be callable, got {type(self.fn).__name__}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"Tool {self.name!r} timeout_s={self.timeout_s} must be > 0 or None")

    def schema(self) -> dict:
        """The OpenAI / Qwen function-calling schema of this tool."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": _plain(self.parameters)}}


def _plain(value: Any) -> Any:
    """Mappings and tuples as dicts and lists (JSON-ready copies)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def truncate_middle(text: str, limit: int) -> str:
    """`text` cut to `limit` characters by dropping its middle, with a marker.

    The head and tail kept add up to `limit` characters; between them goes
    `\\n[... N characters omitted ...]\\n`.
    """
    if limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    omitted = len(text) - limit
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail:]}"


def _render_output(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _exception_message(err: BaseException) -> str:
    if isinstance(err, ToolError):
        return str(err)
    message = str(err)
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def normalize_call(call: Any) -> tuple[str, Any]:
    """`(name, arguments)` from a call in any of the formats a rollout produces.

    Accepts `{"name", "arguments"}` (Hermes / PORTool), OpenAI's
    `{"function": {"name", "arguments"}}`, or a `(name, arguments)` pair. A
    malformed call gives name `""` (reported to the policy as an unknown tool).
    """
    if isinstance(call, Mapping):
        function = call.get("function") if isinstance(call.get("function"), Mapping) else call
        name = function.get("name")
        return (name if isinstance(name, str) else ""), function.get("arguments")
    if isinstance(call, tuple | list) and len(call) == 2:
        return (call[0] if isinstance(call[0], str) else ""), call[1]
    return "", None


class ToolRegistry:
    """Named tools, their schemas, and never-raising execution.

    Example:
        registry = ToolRegistry([calculator_tool(), response_gen_tool()])

        @registry.tool(parameters={"type": "object", "properties": {
            "city": {"type": "string"}}, "required": ["city"]})
        def weather(city):
            "Current weather in a city."
            return {"city": city, "forecast": "sunny"}

        registry.call("weather", '{"city": "Paris"}').content
        # '{"city": "Paris", "forecast": "sunny"}'

    Args:
      tools: tools to register.
      timeout_s: default per-call limit in seconds (None: no limit). A call
        that runs over it is reported as timed out; its thread cannot be
        killed and finishes in the background, so tools that may hang should
        enforce their own limit too (the sandbox does).
      max_output_chars: default output limit; longer outputs lose their middle.
    """

    def __init__(self, tools: Iterable[Tool] = (), *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 or None")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars={max_output_chars} must be >= 1")
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        """Add a tool; raises ValueError if its name is taken."""
        if not isinstance(tool, Tool):
            raise ValueError(f"register() takes a Tool, got {type(tool).__name__}; wrap the "
                             "function with Tool(name, description, parameters, fn)")
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered; pick another name")
        self._tools[tool.name] = tool
        return tool

    def tool(self, name: str | None = None, description: str | None = None,
             parameters: Mapping[str, Any] | None = None, **options: Any):
        """Decorator registering a function as a tool.

        `name` defaults to the function's name, `description` to its
        docstring, `parameters` to an object schema without arguments;
        `options` are `Tool`'s `timeout_s`, `max_output_chars`, `final`.
        """
        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.register(Tool(
                name or fn.__name__, description or (fn.__doc__ or "").strip(),
                parameters or {"type": "object", "properties": {}}, fn, **options))
            return fn
        return decorate

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __len__(self) -> int:
        return len(self._tools)

    def names(self) -> list[str]:
        return list(self._tools)

    def final_tool_names(self) -> list[str]:
        """Names of the tools whose successful call completes a trajectory."""
        return [name for name, tool in self._tools.items() if tool.final]

    def schemas(self) -> list[dict]:
        """Every tool's function schema, in registration order (the chat template's `tools`)."""
        return [tool.schema() for tool in self._tools.values()]

    def call(self, name: str, arguments: Mapping[str, Any] | str | None = None) -> ToolResult:
        """Execute one call; never raises.

        Args:
          name: the tool name the policy wrote.
          arguments: a dict, or its JSON text as the policy wrote it (None: `{}`).

        Returns:
          A `ToolResult`; on any problem `ok=False` and `content` is
          `"Error: <message>"` for the policy.
        """
        start = time.perf_counter()
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            available = ", ".join(sorted(self._tools)) or "none"
            plain = isinstance(name, str) and name.isprintable() and len(name) <= 64
            shown = f"'{name}'" if plain else _show(name)
            message = f"unknown tool {shown}. Available tools: {available}."
            return self._failure(message, name, start, self.max_output_chars)
        decoded, message = _decode_arguments(name, arguments)
        limit = tool.max_output_chars or self.max_output_chars
        if message is None:
            errors = validate_arguments(decoded, tool.parameters)
            if errors:
                message = f"invalid arguments for tool '{name}': " + "; ".join(errors) + "."
        if message is not None:
            return self._failure(message, name, start, limit)
        timeout = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        value, message = _run_with_timeout(tool.fn, decoded, timeout)
        if message is not None:
            return self._failure(f"tool '{name}' {message}", name, start, limit)
        content = truncate_middle(_render_output(value), limit)
        return ToolResult(content, True, None, time.perf_counter() - start, name, tool.final)

    def call_many(self, calls: Sequence[Any], max_workers: int = 8) -> list[ToolResult]:
        """Execute calls in parallel threads; results in the order of `calls`.

        Args:
          calls: each `{"name", "arguments"}`, OpenAI's `{"function": {...}}`,
            or a `(name, arguments)` pair (see `normalize_call`).
          max_workers: thread count.
        """
        pairs = [normalize_call(call) for call in calls]
        if len(pairs) <= 1 or max_workers <= 1:
            return [self.call(name, arguments) for name, arguments in pairs]
        with concurrent.futures.ThreadPoolExecutor(min(max_workers, len(pairs))) as pool:
            return list(pool.map(lambda pair: self.call(*pair), pairs))

    @staticmethod
    def _failure(message: str, name: Any, start: float, limit: int) -> ToolResult:
        message = truncate_middle(message, limit)
        return ToolResult.failure(message, name=name if isinstance(name, str) else "",
                                  latency_s=time.perf_counter() - start)


def _decode_arguments(name: str, arguments: Any) -> tuple[Any, str | None]:
    """The arguments as a dict, or an error message for the policy."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        arguments, err = parse_json(arguments)
        if err is not None:
            return None, (f"arguments of tool '{name}' must be a JSON object; got invalid "
                          f"JSON ({err}).")
    if not isinstance(arguments, Mapping):
        return None, (f"arguments of tool '{name}' must be a JSON object, got "
                      f"{_json_type(arguments)}.")
    return dict(arguments), None


def _run_with_timeout(fn: Callable[..., Any], arguments: dict,
                      timeout_s: float | None) -> tuple[Any, str | None]:
    """`(value, None)`, or `(None, "failed: ...")` / `(None, "timed out ...")`."""
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = fn(**arguments)
        except BaseException as err:  # a tool's failure is the policy's output, never ours
            outcome["error"] = err

    if timeout_s is None:
        target()
    else:
        thread = threading.Thread(target=target, daemon=True, name="agentrl-tool")
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            return None, f"timed out after {timeout_s:g} s."
    if "error" in outcome:
        return None, f"failed: {_exception_message(outcome['error'])}."
    return outcome.get("value"), None


# ---------------------------------------------------------------------------------------------
# Built-in tools
# ---------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_DEPTH = 100
MAX_INT_BITS = 10_000  # about 3,000 decimal digits; below Python's 4,300-digit str limit

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt,
    "floor": math.floor, "ceil": math.ceil, "exp": math.exp, "log": math.log,
    "log10": math.log10,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _check_size(value: Any) -> Any:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"the result is too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    return value


def _power(base: Any, exponent: Any) -> Any:
    integers = isinstance(base, int) and isinstance(exponent, int)
    # exponent * (bit_length - 1) bounds the result's size from below: refuse before computing.
    if integers and abs(base) > 1 and exponent * (abs(base).bit_length() - 1) > MAX_INT_BITS:
        raise ToolError(f"the exponent {exponent} is too large for base {base}")
    return base ** exponent


def _evaluate(node: ast.AST, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ToolError(f"the expression is nested too deeply (more than {MAX_DEPTH} levels)")
    depth += 1
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ToolError(f"unsupported constant {node.value!r}; only numbers are allowed")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_size(_UNARY[type(node.op)](_evaluate(node.operand, depth)))
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, depth), _evaluate(node.right, depth)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        if type(node.op) in _BINARY:
            return _check_size(_BINARY[type(node.op)](left, right))
        if isinstance(node.op, ast.BitXor):
            raise ToolError("'^' is not a power operator here; write '**'")
        raise ToolError(f"unsupported operator {type(node.op).__name__}")
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise ToolError(f"unknown name {node.id!r}; constants: {', '.join(_CONSTANTS)}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return _evaluate_call(node, depth)
    shown = node.func if isinstance(node, ast.Call) else node  # e.g. `x.y()`: the Attribute
    raise ToolError(f"unsupported syntax ({type(shown).__name__}); use numbers, + - * / // % ** "
                    f"and parentheses")


def _evaluate_call(node: ast.Call, depth: int) -> Any:
    name = node.func.id
    if name not in _FUNCTIONS:
        raise ToolError(f"unsupported function {name!r}; functions: {', '.join(_FUNCTIONS)}")
    if node.keywords:
        raise ToolError(f"{name}() takes positional arguments only")
    args = [_evaluate(arg, depth) for arg in node.args]
    try:
        return _check_size(_FUNCTIONS[name](*args))
    except TypeError as err:
        raise ToolError(f"{name}(): {err}") from None


def _format_number(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    return format(value, ".15g")


def evaluate_expression(expression: str, *, max_chars: int = MAX_EXPRESSION_CHARS) -> str:
    """Evaluate an arithmetic expression safely (AST walk, no `eval`).

    Grammar: int and float literals, `+ - * / // % **`, unary `-` / `+`,
    parentheses, the constants `pi`, `e` and the functions `abs round min
    max sqrt floor ceil exp log log10`. Integer results are exact; floats
    print with 15 significant digits.

    Raises:
      ToolError: with a message for the policy on invalid syntax, a name or
        construct outside the grammar, division by zero, a math domain error,
        a result above `MAX_INT_BITS` bits or not finite, or an expression
        longer than `max_chars`.
    """
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {_json_type(expression)}")
    if len(expression) > max_chars:
        raise ToolError(f"the expression is {len(expression)} characters long; the limit is "
                        f"{max_chars}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _evaluate(tree)
    except SyntaxError as err:
        raise ToolError(f"invalid expression: {err.msg}") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("the result is too large") from None
    except ValueError as err:
        raise ToolError(f"math error: {err}") from None
    except (RecursionError, MemoryError):
        raise ToolError(f"the expression is nested too deeply (more than {MAX_DEPTH} "
                        "levels)") from None
    return _format_number(value)


def calculator_tool(name: str = "calculator") -> Tool:
    """A safe arithmetic calculator (`evaluate_expression`)."""
    return Tool(
        name,
        "Evaluate an arithmetic expression and return the number. Supports + - * / // % ** "
        "and parentheses, the constants pi and e, and the functions abs, round, min, max, "
        "sqrt, floor, ceil, exp, log, log10. Example: (3 + 4) * 2 ** 3",
        {"type": "object",
         "properties": {"expression": {"type": "string",
                                       "description": "The arithmetic expression."}},
         "required": ["expression"], "additionalProperties": False},
        lambda expression: evaluate_expression(expression),
    )


def response_gen_tool(name: str = "response_gen") -> Tool:
    """PORTool's final-answer tool (`portool_rewarded_tree.txt` App. D, its `response_gen` schema).

    Its schema is the paper's: `response` (required), `query`, `context`,
    `items`. A successful call returns the response text and marks the
    trajectory complete (`ToolResult.final`).
    """
    def respond(response: str, query: str | None = None, context: str | None = None,
                items: list | None = None) -> str:
        del query, context, items
        return response

    return Tool(
        name, "Response generation.",
        {"type": "object",
         "properties": {
             "response": {"type": "string", "description": "Response to be generated."},
             "query": {"type": "string", "description": "User query or rewritten query."},
             "context": {"type": "string", "description": "Context for response generation."},
             "items": {"type": "array", "items": {"type": "object"},
                       "description": "Items with entities and facts."}},
         "required": ["response"]},
        respond, final=True,
    )


def python_tool(name: str = "python", *, timeout_s: float = 5.0, memory_mb: int = 512,
                **options: Any) -> Tool:
    """Run Python code in the sandbox (`agentrl.envs.sandbox.python_tool`).

    The output is the sandbox's text for the policy: stdout, the tail of
    stderr, and a status line such as `[exit code 1]` or `[timed out after
    5.0 s]`. `options` go to the sandbox (`max_chars`, `cpu_s`, ...). The
    sandbox module is imported at the first call, so this module imports
    without it.
    """
    def run(code: str) -> str:
        from agentrl.envs import sandbox  # lazy: the sandbox is optional here

        return sandbox.python_tool(code, timeout_s=timeout_s, memory_mb=memory_mb, **options)

    return Tool(
        name, "Execute Python code and return what it prints (stdout, then stderr).",
        {"type": "object",
         "properties": {"code": {"type": "string", "description": "Python source to run."}},
         "required": ["code"], "additionalProperties": False},
        run, timeout_s=timeout_s + 10.0,
    )
