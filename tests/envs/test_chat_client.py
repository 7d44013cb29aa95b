"""ChatClient against a real local HTTP server: format, retries, timeouts, key hygiene."""

import socket
import time
import traceback

import pytest

from agentrl.envs.chat_client import ChatClient, ChatClientError, parse_json_reply
from tests.envs.scripted_llm import Reply, ScriptedLLMServer

SECRET = "sk-test-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def server():
    with ScriptedLLMServer() as server:
        yield server


def client_for(server, **options):
    options = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01, **options}
    return ChatClient(server.base_url, "judge-model", **options)


def test_request_format_and_reply(server):
    server.add(Reply(["The answer."]))
    client = client_for(server)
    assert client.chat(MESSAGES, temperature=0.3, max_tokens=64, stop=["</s>"]) == ["The answer."]
    request = server.received[0]
    assert request.path == "/v1/chat/completions"
    assert request.body == {"model": "judge-model", "messages": MESSAGES, "temperature": 0.3,
                            "max_tokens": 64, "n": 1, "stop": ["</s>"]}
    assert "Authorization" not in request.headers
    assert client.stats.prompt_tokens == 10 and client.stats.completion_tokens == 5


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/", "/v1/chat/completions"])
def test_base_url_with_or_without_v1(server, suffix):
    client = ChatClient(server.base_url + suffix, "m")
    assert client.url == server.base_url + "/v1/chat/completions"
    assert client.chat(MESSAGES) == ["ok"]


def test_n_samples_and_servers_that_return_fewer(server):
    server.add(Reply(["a"]), Reply(["b", "c"]))
    assert client_for(server).chat(MESSAGES, n=3) == ["a", "b", "c"]
    assert [r.body["n"] for r in server.received] == [3, 2]


def test_api_key_is_sent_but_never_shown(server, monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_KEY", SECRET)
    client = client_for(server, api_key_env="AGENTRL_TEST_KEY", max_retries=1)
    server.add(Reply(), Reply(status=500, error=f"bad key {SECRET}"),
               Reply(status=500, error=f"bad key {SECRET}"))
    assert client.chat(MESSAGES) == ["ok"]
    assert server.received[0].headers["Authorization"] == f"Bearer {SECRET}"
    assert SECRET not in repr(client) and "AGENTRL_TEST_KEY" in repr(client)
    with pytest.raises(ChatClientError) as info:
        client.chat(MESSAGES)
    rendered = "".join(traceback.format_exception(info.value))
    assert "HTTP 500: " in str(info.value) and "bad key ***" in str(info.value)
    assert SECRET not in rendered and SECRET not in repr(info.value)


def test_unset_key_variable_is_a_clear_error(server, monkeypatch):
    monkeypatch.delenv("AGENTRL_MISSING_KEY", raising=False)
    with pytest.raises(ValueError, match="'AGENTRL_MISSING_KEY' \\(api_key_env\\) is not set"):
        client_for(server, api_key_env="AGENTRL_MISSING_KEY")


def test_500_then_success_is_retried(server):
    server.add(Reply(status=500), Reply(status=503), Reply(["fine"]))
    client = client_for(server)
    assert client.chat(MESSAGES) == ["fine"]
    assert len(server.received) == 3
    assert client.stats.retries == 2 and client.stats.failures == 0


def test_429_honours_retry_after_then_gives_up(server):
    server.add(Reply(status=429, headers={"Retry-After": "0.2"}), Reply(["after wait"]))
    client = client_for(server, backoff_max_s=1.0)
    start = time.perf_counter()
    assert client.chat(MESSAGES) == ["after wait"]
    assert time.perf_counter() - start >= 0.2
    server.add(*[Reply(status=429, error="rate limited")] * 3)
    with pytest.raises(ChatClientError) as info:
        client.chat(MESSAGES)
    error = info.value
    assert (error.status, error.attempts) == (429, 3)
    assert str(error).startswith(f"POST {server.base_url}/v1/chat/completions "
                                 "(model='judge-model', 1 messages, n=1) failed after 3 "
                                 "attempt(s): HTTP 429: ")
    assert "rate limited" in str(error)


def test_client_errors_are_not_retried(server):
    server.add(Reply(status=400, error="bad request: unknown model"))
    with pytest.raises(ChatClientError, match=r"HTTP 400: .*unknown model") as info:
        client_for(server).chat(MESSAGES)
    assert info.value.attempts == 1 and len(server.received) == 1


def test_slow_server_times_out_and_is_retried(server):
    server.add(Reply(delay_s=1.0), Reply(delay_s=1.0))
    client = client_for(server, timeout_s=0.2, max_retries=1)
    start = time.perf_counter()
    with pytest.raises(ChatClientError, match=r"timed out after 0\.2 s") as info:
        client.chat(MESSAGES)
    assert info.value.attempts == 2 and info.value.status is None
    assert time.perf_counter() - start < 1.5


def test_connection_refused_names_the_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ChatClient(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.01)
    with pytest.raises(ChatClientError, match=f"127.0.0.1:{port}.*connection error") as info:
        client.chat(MESSAGES)
    assert info.value.attempts == 2


def test_non_json_body_is_an_error(server):
    server.add(Reply(raw=b"<html>gateway</html>"))
    with pytest.raises(ChatClientError, match="not JSON"):
        client_for(server).chat(MESSAGES)
    server.add(Reply(raw=b'{"object": "error"}'))
    with pytest.raises(ChatClientError, match="no 'choices'"):
        client_for(server).chat(MESSAGES)


def test_constructor_validation():
    with pytest.raises(ValueError, match="must be an http"):
        ChatClient("localhost:8000", "m")
    with pytest.raises(ValueError, match="model=''"):
        ChatClient("http://localhost:8000", "")


@pytest.mark.parametrize("text,expected", [
    ('{"answer": true}', {"answer": True}),
    ('<think>{"answer": false}</think>\n{"answer": true}', {"answer": True}),
    ('```json\n{"answer": true}\n```', {"answer": True}),
    ('Verdict: {"answer": true} -- done', {"answer": True}),
])
def test_parse_json_reply_reads_leniently(text, expected):
    assert parse_json_reply(text) == (expected, None)


@pytest.mark.parametrize("text,error", [
    ("", "empty reply"), ("[1, 2]", "expected a JSON object, got list"),
    ("no json here", "no JSON object found"), ('{"answer": tru', "JSONDecodeError"),
    (None, "empty reply"),
])
def test_parse_json_reply_failures(text, error):
    value, message = parse_json_reply(text)
    assert value is None and error in message
