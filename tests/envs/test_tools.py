"""Tool registry: schemas, validation messages, failures, timeouts, truncation, built-ins."""

import threading
import time

import pytest

from agentrl.envs.tools import (
    Tool,
    ToolError,
    ToolRegistry,
    ToolResult,
    calculator_tool,
    evaluate_expression,
    python_tool,
    response_gen_tool,
    truncate_middle,
    validate_arguments,
)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name."},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "filters": {"type": "object", "properties": {"max_rain": {"type": "number"}},
                    "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture
def registry():
    registry = ToolRegistry([calculator_tool(), response_gen_tool()], timeout_s=2.0)

    @registry.tool(parameters=WEATHER_SCHEMA)
    def weather(city, unit="C", days=1, filters=None, tags=None):
        """Weather forecast for a city."""
        return {"city": city, "unit": unit, "days": days}

    @registry.tool(parameters={"type": "object", "properties": {}})
    def explode():
        """Always fails."""
        raise KeyError("secret_internal_key")

    return registry


def test_schema_is_the_qwen_function_format(registry):
    schemas = registry.schemas()
    assert [s["function"]["name"] for s in schemas] == [
        "calculator", "response_gen", "weather", "explode"]
    weather = schemas[2]
    assert weather["type"] == "function"
    assert weather["function"]["description"] == "Weather forecast for a city."
    assert weather["function"]["parameters"] == WEATHER_SCHEMA
    assert registry.final_tool_names() == ["response_gen"]


def test_valid_call_returns_json_output(registry):
    result = registry.call("weather", '{"city": "Paris", "days": 3}')
    assert result.ok and result.error is None and result.name == "weather"
    assert result.content == '{"city": "Paris", "unit": "C", "days": 3}'
    assert result.latency_s >= 0


@pytest.mark.parametrize("arguments,message", [
    ({}, "invalid arguments for tool 'weather': missing required argument 'city' (string)."),
    ({"city": "Paris", "country": "FR"},
     "invalid arguments for tool 'weather': unexpected argument 'country'; expected arguments: "
     "city, unit, days, filters, tags."),
    ({"city": 42}, "invalid arguments for tool 'weather': argument 'city' must be string, "
                   "got integer 42."),
    ({"city": "Paris", "unit": "K"},
     "invalid arguments for tool 'weather': argument 'unit' must be one of [\"C\", \"F\"], "
     "got \"K\"."),
    ({"city": "Paris", "days": 0},
     "invalid arguments for tool 'weather': argument 'days' must be >= 1, got 0."),
    ({"city": "Paris", "days": True},
     "invalid arguments for tool 'weather': argument 'days' must be integer, got boolean true."),
    ({"city": "Paris", "filters": {"max_rain": "lots"}},
     "invalid arguments for tool 'weather': argument 'filters.max_rain' must be number, "
     "got string \"lots\"."),
    ({"city": "Paris", "tags": ["a", 2]},
     "invalid arguments for tool 'weather': argument 'tags[1]' must be string, got integer 2."),
    ({"unit": 3}, "invalid arguments for tool 'weather': missing required argument 'city' "
                  "(string); argument 'unit' must be string, got integer 3."),
])
def test_validation_messages_name_the_argument(registry, arguments, message):
    result = registry.call("weather", arguments)
    assert not result.ok
    assert result.error == message
    assert result.content == "Error: " + message


def test_integral_float_is_an_integer_and_numbers_accept_ints(registry):
    assert registry.call("weather", {"city": "Paris", "days": 2.0}).ok
    assert validate_arguments({"x": 3}, {"type": "object",
                                         "properties": {"x": {"type": "number"}}}) == []
    assert validate_arguments({"x": 2.5}, {"type": "object", "properties": {
        "x": {"type": "integer"}}}) == ["argument 'x' must be integer, got number 2.5"]


def test_unknown_tool_lists_the_available_ones(registry):
    result = registry.call("wether", {"city": "Paris"})
    assert result.content == ("Error: unknown tool 'wether'. Available tools: calculator, "
                              "explode, response_gen, weather.")
    assert not result.ok


def test_arguments_that_are_not_a_json_object(registry):
    bad_json = registry.call("weather", '{"city": "Paris"')
    assert bad_json.error.startswith(
        "arguments of tool 'weather' must be a JSON object; got invalid JSON (JSONDecodeError")
    array = registry.call("weather", '["Paris"]')
    assert array.error == "arguments of tool 'weather' must be a JSON object, got array."
    assert registry.call("explode", "").error.startswith("tool 'explode' failed: KeyError")


def test_exceptions_become_results_without_traceback(registry):
    result = registry.call("explode", {})
    assert not result.ok
    assert result.content == "Error: tool 'explode' failed: KeyError: 'secret_internal_key'."
    assert "Traceback" not in result.content and "tools.py" not in result.content


def test_tool_error_sends_its_message_only():
    def lookup(key):
        raise ToolError(f"no entry named {key!r}")

    registry = ToolRegistry([Tool("lookup", "Look up.", {"type": "object", "properties": {
        "key": {"type": "string"}}}, lookup)])
    result = registry.call("lookup", {"key": "x"})
    assert result.error == "tool 'lookup' failed: no entry named 'x'."


def test_timeout_is_reported_and_the_call_returns():
    release = threading.Event()
    registry = ToolRegistry(timeout_s=0.2)
    registry.register(Tool("hang", "Hangs.", {"type": "object", "properties": {}},
                           lambda: release.wait(5)))
    start = time.perf_counter()
    result = registry.call("hang", {})
    release.set()
    assert time.perf_counter() - start < 2.0
    assert result.error == "tool 'hang' timed out after 0.2 s."
    assert not result.ok


def test_per_tool_timeout_overrides_the_registry():
    registry = ToolRegistry(timeout_s=0.05)
    registry.register(Tool("slow", "Sleeps.", {"type": "object", "properties": {}},
                           lambda: time.sleep(0.2) or "done", timeout_s=2.0))
    assert registry.call("slow", {}).content == "done"


def test_long_outputs_are_truncated_in_the_middle():
    registry = ToolRegistry(max_output_chars=100)
    registry.register(Tool("big", "Big output.", {"type": "object", "properties": {}},
                           lambda: "a" * 500 + "b" * 500))
    content = registry.call("big", {}).content
    assert content == "a" * 50 + "\n[... 900 characters omitted ...]\n" + "b" * 50
    assert truncate_middle("x" * 10, 10) == "x" * 10
    assert truncate_middle("abcdefghij", 3) == "a\n[... 7 characters omitted ...]\nij"


def test_call_many_runs_in_parallel_and_keeps_order():
    registry = ToolRegistry()
    barrier = threading.Barrier(4, timeout=2)

    @registry.tool(parameters={"type": "object", "properties": {"i": {"type": "integer"}}})
    def echo(i):
        """Echo after all four calls have started (fails unless they run concurrently)."""
        barrier.wait()
        time.sleep(0.01 * (4 - i))  # later calls finish first
        return str(i)

    calls = [{"name": "echo", "arguments": {"i": i}} for i in range(4)]
    results = registry.call_many(calls, max_workers=4)
    assert [r.content for r in results] == ["0", "1", "2", "3"]


def test_call_many_accepts_openai_and_pair_formats(registry):
    calls = [
        {"id": "1", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}},
        ("calculator", {"expression": "3*3"}),
        {"name": "nope", "arguments": {}},
        42,
    ]
    results = registry.call_many(calls)
    assert [r.content for r in results][:2] == ["4", "9"]
    assert results[2].error.startswith("unknown tool 'nope'")
    assert results[3].error.startswith("unknown tool ''")


def test_registration_errors():
    registry = ToolRegistry([calculator_tool()])
    with pytest.raises(ValueError, match="already registered"):
        registry.register(calculator_tool())
    with pytest.raises(ValueError, match=r"unsupported JSON-schema keyword\(s\) \['oneOf'\]"):
        Tool("t", "", {"type": "object", "properties": {"x": {"oneOf": []}}}, print)
    with pytest.raises(ValueError, match='must have "type": "object"'):
        Tool("t", "", {"type": "string"}, print)
    with pytest.raises(ValueError, match="Tool name 'bad name'"):
        Tool("bad name", "", {"type": "object"}, print)


def test_response_gen_is_final_and_returns_the_answer(registry):
    result = registry.call("response_gen", {"response": "It is sunny.", "query": "weather?"})
    assert result == ToolResult("It is sunny.", True, None, result.latency_s, "response_gen",
                                final=True)
    missing = registry.call("response_gen", {"query": "weather?"})
    assert not missing.ok and not missing.final
    assert "missing required argument 'response' (string)" in missing.error


@pytest.mark.parametrize("expression,value", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("7 // 2", "3"),
    ("-7 % 3", "2"), ("2 ** 10", "1024"), ("-2 ** 2", "-4"), ("--3", "3"), ("0.1 + 0.2", "0.3"),
    ("sqrt(16)", "4"), ("abs(-2.5)", "2.5"), ("2 ** -1", "0.5"), ("10 ** 100", "1" + "0" * 100),
    ("max(1, 5, 3)", "5"), ("round(pi, 2)", "3.14"),
])
def test_calculator_values(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize("expression,message", [
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("9 ** 9 ** 9", "the exponent 387420489 is too large for base 9"),
    ("2 ** 20000", "the exponent 20000 is too large for base 2"),
    ("10.0 ** 400", "the result is too large"),
    ("(-8) ** 0.5", "the result is not a real number"),
    ("sqrt(-1)", "math error: math domain error"),
    ("__import__('os').system('ls')", "unsupported syntax (Attribute)"),
    ("__import__('os')", "unsupported function '__import__'"),
    ("open('/etc/passwd')", "unsupported function 'open'"),
    ("(1).__class__", "unsupported syntax (Attribute)"),
    ("[x for x in ()]", "unsupported syntax (ListComp)"),
    ("lambda: 1", "unsupported syntax (Lambda)"),
    ("'a' * 3", "unsupported constant 'a'"),
    ("True + 1", "unsupported constant True"),
    ("x + 1", "unknown name 'x'"),
    ("2 ^ 3", "'^' is not a power operator here; write '**'"),
    ("1 +", "invalid expression: invalid syntax"),
    ("1" * 1001, "the expression is 1001 characters long; the limit is 1000"),
    ("-" * 150 + "1", "the expression is nested too deeply (more than 100 levels)"),
    ("-" * 999 + "1", "the expression is nested too deeply (more than 100 levels)"),
    ("(" * 500 + "1" + ")" * 500, "the expression is 1001 characters long"),
    ("(" * 300 + "1" + ")" * 300, "invalid expression: too many nested parentheses"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(ToolError) as info:
        evaluate_expression(expression)
    assert str(info.value).startswith(message)


def test_calculator_errors_reach_the_policy_as_tool_results(registry):
    result = registry.call("calculator", {"expression": "1/0"})
    assert result.content == "Error: tool 'calculator' failed: division by zero."


def test_python_tool_runs_code_in_the_sandbox():
    tool = python_tool(timeout_s=5.0)
    assert tool.schema()["function"]["parameters"]["required"] == ["code"]
    registry = ToolRegistry([tool])
    result = registry.call("python", {"code": "print(6 * 7)"})
    assert result.ok and result.content.strip() == "42"
    failing = registry.call("python", {"code": "raise ValueError('boom')"})
    assert "ValueError: boom" in failing.content and "[exit code 1]" in failing.content
