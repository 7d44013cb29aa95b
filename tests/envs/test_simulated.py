"""CM2 hybrid tool simulator: canonical keys, replay, LLM simulation, retries, failures."""

import json

import pytest

from agentrl.envs.chat_client import ChatClient
from agentrl.envs.simulated import (
    SIMULATOR_SYSTEM_PROMPT,
    HybridToolSimulator,
    ToolRecord,
    canonical_arguments,
    records_from_messages,
)
from tests.envs.scripted_llm import Reply, ScriptedLLMServer, last_user_content

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city on a date.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "date": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}
PRODUCTS = {"name": "search_products", "description": "Search the shop.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                            "max_price": {"type": "number"}}}}

DIALOGUE = [
    {"role": "user", "content": "Weather in Paris and Rome tomorrow? Also cheap umbrellas."},
    {"role": "assistant", "content": "<think>two cities</think>", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris", "date": "2025-05-02"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"date": "2025-05-02", "city": "Rome"}}},
    ]},
    # Answers out of order: matched by tool_call_id.
    {"role": "tool", "tool_call_id": "call_2", "content": '{"city": "Rome", "forecast": "sun"}'},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"city": "Paris", "forecast": "rain"}'},
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "search_products",
                      "arguments": {"query": "umbrella", "max_price": 20.0}}}]},
    {"role": "tool", "content": '[{"name": "Compact umbrella", "price": 12.5}]'},
    {"role": "assistant", "content": "Rain in Paris, sun in Rome; a compact umbrella is 12.5."},
]


def simulated_reply(result, analysis="Following the examples."):
    return json.dumps({"analysis": analysis, "execution_result": result})


@pytest.fixture
def server():
    with ScriptedLLMServer() as server:
        yield server


@pytest.fixture
def simulator(server):
    client = ChatClient(server.base_url, "simulator", max_retries=0, timeout_s=5.0)
    return HybridToolSimulator.from_dialogue(client, DIALOGUE, [WEATHER, PRODUCTS],
                                             max_retries=2)


def test_canonical_arguments():
    assert canonical_arguments({"b": 1, "a": [2.0, {"y": 1.5, "x": True}]}) == \
        '{"a":[2,{"x":true,"y":1.5}],"b":1}'
    assert canonical_arguments('{"b": 1.0, "a": "é"}') == '{"a":"é","b":1}'
    assert canonical_arguments({"flag": True}) != canonical_arguments({"flag": 1})
    assert canonical_arguments({"n": "2"}) != canonical_arguments({"n": 2})
    assert canonical_arguments(None) == canonical_arguments("") == "{}"
    assert canonical_arguments(" {not json ") == "{not json"


def test_records_pair_by_id_and_by_position():
    records = records_from_messages(DIALOGUE)
    assert records == [
        ToolRecord("get_weather", {"date": "2025-05-02", "city": "Rome"},
                   '{"city": "Rome", "forecast": "sun"}'),
        ToolRecord("get_weather", '{"city": "Paris", "date": "2025-05-02"}',
                   '{"city": "Paris", "forecast": "rain"}'),
        ToolRecord("search_products", {"query": "umbrella", "max_price": 20.0},
                   '[{"name": "Compact umbrella", "price": 12.5}]'),
    ]


def test_exact_match_replays_without_a_request(server, simulator):
    paris = simulator.call("get_weather", {"date": "2025-05-02", "city": "Paris"})
    assert paris.ok and paris.content == '{"city": "Paris", "forecast": "rain"}'
    shop = simulator.call("search_products", '{"max_price": 20, "query": "umbrella"}')
    assert shop.content == '[{"name": "Compact umbrella", "price": 12.5}]'
    assert server.received == []
    assert simulator.stats.replayed == 2 and simulator.stats.simulated == 0


def test_new_arguments_are_simulated_with_the_a15_prompt(server, simulator):
    server.add(Reply([simulated_reply({"city": "Oslo", "forecast": "snow"})]))
    result = simulator.call("get_weather", {"city": "Oslo", "date": "2025-05-02"})
    assert result.ok and json.loads(result.content) == {"city": "Oslo", "forecast": "snow"}
    messages = server.received[0].body["messages"]
    assert messages[0] == {"role": "system", "content": SIMULATOR_SYSTEM_PROMPT}
    user = messages[1]["content"]
    # Few-shot examples: this tool's recorded I/O only.
    assert '"forecast": "rain"' in user and '"forecast": "sun"' in user
    assert "umbrella" not in user
    assert "Current tool name: get_weather\nCurrent tool input schema (JSON Schema):\n" in user
    schema = user.split("(JSON Schema):\n")[1].split("\nCurrent arguments")[0]
    assert json.loads(schema) == WEATHER["function"]["parameters"]
    assert user.endswith('Current arguments (JSON):\n{"city": "Oslo", "date": "2025-05-02"}\n'
                         "Generate tool execution result in JSON format.")
    assert server.received[0].body["temperature"] == 0.0
    assert simulator.stats.simulated == 1 and simulator.stats.requests == 1


def test_unparseable_replies_are_retried(server, simulator):
    server.add(Reply(["Sure! The weather is nice."]),
               Reply(['{"analysis": "x", "execution_result": {"temp": ']),
               Reply(["<think>plan</think>```json\n" + simulated_reply("12 degrees") + "\n```"]))
    result = simulator.call("get_weather", {"city": "Nice"})
    assert result.ok and result.content == "12 degrees"
    assert [r.body["temperature"] for r in server.received] == [0.0, 1.0, 1.0]
    stats = simulator.stats
    assert (stats.requests, stats.parse_failures, stats.simulated, stats.failed) == (3, 2, 1, 0)


def test_a_reply_without_execution_result_is_a_parse_failure(server, simulator):
    server.add(*[Reply(['{"analysis": "no result field"}'])] * 3)
    result = simulator.call("get_weather", {"city": "Nice"})
    assert not result.ok
    assert result.content == ("Error: tool 'get_weather' is unavailable: the tool simulator gave "
                              "no valid result.")
    assert simulator.stats.failed == 1 and simulator.stats.parse_failures == 3


def test_server_failure_becomes_a_tool_error(server, simulator):
    server.add(Reply(status=500))
    result = simulator.call("get_weather", {"city": "Nice"})
    assert not result.ok and "tool simulator gave no valid result" in result.error
    assert simulator.stats.failed == 1


def test_unknown_tool_and_bad_arguments_are_rejected_without_a_request(server, simulator):
    unknown = simulator.call("get_wether", {"city": "Paris"})
    assert unknown.error == ("unknown tool 'get_wether'. Available tools: get_weather, "
                             "search_products.")
    assert simulator.call("get_weather", "{bad json").error == \
        "arguments of tool 'get_weather' must be a JSON object."
    assert simulator.call("get_weather", "[1]").error == \
        "arguments of tool 'get_weather' must be a JSON object."
    assert server.received == [] and simulator.stats.rejected == 3


def test_call_many_mixes_replay_and_simulation_in_order(server):
    def echo_city(body):
        arguments = json.loads(last_user_content(body).split("Current arguments (JSON):\n")[1]
                               .split("\n")[0])
        return simulated_reply({"city": arguments["city"], "forecast": "simulated"})

    server.handler = echo_city
    client = ChatClient(server.base_url, "simulator", max_retries=0)
    simulator = HybridToolSimulator.from_dialogue(client, DIALOGUE, [WEATHER, PRODUCTS])
    calls = [{"name": "get_weather", "arguments": {"city": city, "date": "2025-05-02"}}
             for city in ["Paris", "Oslo", "Rome", "Lima"]]
    results = simulator.call_many(calls, max_workers=4)
    assert [json.loads(r.content)["city"] for r in results] == ["Paris", "Oslo", "Rome", "Lima"]
    assert [json.loads(r.content)["forecast"] for r in results] == [
        "rain", "simulated", "sun", "simulated"]
    assert simulator.stats.replayed == 2 and simulator.stats.simulated == 2


def test_schemas_are_in_function_format(simulator):
    assert [s["function"]["name"] for s in simulator.schemas()] == [
        "get_weather", "search_products"]
    assert all(s["type"] == "function" for s in simulator.schemas())
