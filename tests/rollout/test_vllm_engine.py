"""`VLLMEngine` against real HTTP servers speaking vLLM's protocol (`agentrl serve` in-process).

vLLM itself cannot run on CPU; the servers here are `agentrl.rollout.server`
front ends over one `JaxEngine` (tests/rollout/serving.py), so every result
is compared with `JaxEngine.generate` on the same parameters. Dead servers are
closed ports; a silent server accepts connections and never answers.
"""

import json
import time
import urllib.request

import numpy as np
import pytest

from agentrl.models import Policy
from agentrl.rollout.engine import Engine, SamplingParams
from agentrl.rollout.server import OpenAIServer
from agentrl.rollout.vllm_engine import VLLMEngine, VLLMEngineError
from tests.rollout import serving

PROMPTS = [[10, 20, 30], [40, 50, 60, 70], [80], [90, 91]]


@pytest.fixture(scope="module")
def servers():
    fronts = [OpenAIServer(serving.backend(), port=0, max_wait_ms=5).start() for _ in range(2)]
    yield fronts
    for front in fronts:
        front.shutdown()


@pytest.fixture
def engine(servers):
    client = VLLMEngine([s.url for s in servers], "policy", timeout_s=120, backoff_s=0.01)
    yield client
    client.close()


def direct(prompts, params, model=serving.SERVED):
    return serving.backend().generate(model, [list(p) for p in prompts], list(params))


def engine_models(front) -> list[dict]:
    with urllib.request.urlopen(front.url + "/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"]


def completions_served(front) -> int:
    return front.request_counts.get("/v1/completions", 0)


def test_generate_equals_jax_engine_greedy_and_seeded(engine):
    assert isinstance(engine, Engine)
    params = [SamplingParams(temperature=0.0, max_new_tokens=6),
              SamplingParams(temperature=1.0, max_new_tokens=6, seed=7),
              SamplingParams(temperature=0.7, top_p=0.8, top_k=40, max_new_tokens=5, seed=-3),
              SamplingParams(temperature=1.0, max_new_tokens=6, seed=2**64 + 11,
                             stop_token_ids=(5,))]
    got = engine.generate(PROMPTS, params)
    want = direct(PROMPTS, params)
    for completion, expected in zip(got, want, strict=True):
        assert completion.token_ids == expected.token_ids
        np.testing.assert_allclose(completion.logprobs, expected.logprobs, atol=1e-5)
        assert completion.finish_reason == expected.finish_reason
    assert got[0].logprobs == [0.0] * 6 and all(lp < 0 for lp in got[1].logprobs)
    # Seeds reproduce across calls; the stream differs between seeds.
    again = engine.generate(PROMPTS[1:2], params[1])
    assert again[0].token_ids == got[1].token_ids
    assert engine.generate([], params[0]) == []


def test_requests_spread_over_servers_and_sticky_keys_hold(engine, servers):
    a, b = servers
    before = [completions_served(a), completions_served(b)]
    prompts = [[i, i + 1] for i in range(1, 9)]
    engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=0))
    spread = [completions_served(a) - before[0], completions_served(b) - before[1]]
    assert sorted(spread) == [4, 4], spread  # least-outstanding alternates on a burst
    # Sticky keys: a trajectory's later turns go where its first turn went, even when
    # least-outstanding routing would spread them.
    keys = [f"trajectory-{i}" for i in range(6)]
    engine.generate([[i, 2] for i in range(6)], SamplingParams(max_new_tokens=2, seed=1),
                    sticky_keys=keys)
    homes = {key: engine.sticky_server(key) for key in keys}
    on_a = [key for key in keys if homes[key] == a.url]
    assert 0 < len(on_a) < len(keys)
    counts = [completions_served(a), completions_served(b)]
    engine.generate([[i, 2, 3, 4] for i in range(len(on_a))],
                    SamplingParams(max_new_tokens=2, seed=2), sticky_keys=on_a)
    assert completions_served(a) - counts[0] == len(on_a)
    assert completions_served(b) == counts[1]


def test_failover_from_a_dead_server(servers):
    dead = serving.closed_port_url()
    with VLLMEngine([dead, servers[0].url], "policy", max_retries=2, backoff_s=0.01) as client:
        params = SamplingParams(max_new_tokens=4, seed=5)
        got = client.generate(PROMPTS[:2], params, sticky_keys=["k0", "k1"])
        want = direct(PROMPTS[:2], [params, params])
        assert [c.token_ids for c in got] == [w.token_ids for w in want]
        stats = {s["url"]: s for s in client.server_stats()}
        assert stats[dead]["failures"] >= 1 and stats[dead]["completed"] == 0
        assert stats[servers[0].url]["completed"] == 2
        assert client.retries >= 1
        assert client.sticky_server("k0") == servers[0].url  # rebound to the live server


def test_all_servers_down_names_servers_and_request(monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_VLLM_KEY", "sk-secret-do-not-print")
    dead = [serving.closed_port_url(), serving.closed_port_url()]
    client = VLLMEngine(dead, "policy", max_retries=2, backoff_s=0.01,
                        api_key_env="AGENTRL_TEST_VLLM_KEY")
    try:
        with pytest.raises(VLLMEngineError) as info:
            client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    finally:
        client.close()
    message = str(info.value)
    assert "request 0" in message and "3 attempt(s)" in message
    assert all(url in message for url in dead)
    assert set(info.value.servers) == set(dead) and info.value.index == 0
    assert "sk-secret" not in message and "sk-secret" not in repr(client)


def test_api_key_is_sent_and_never_shown(monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_VLLM_KEY", "sk-right-key")
    front = OpenAIServer(serving.backend(), port=0, api_key="sk-right-key").start()
    try:
        with VLLMEngine([front.url], "policy", api_key_env="AGENTRL_TEST_VLLM_KEY") as client:
            params = SamplingParams(max_new_tokens=3, seed=4)
            got = client.generate([[4, 5, 6]], params)
            assert got[0].token_ids == direct([[4, 5, 6]], [params])[0].token_ids
        monkeypatch.setenv("AGENTRL_TEST_VLLM_KEY", "sk-wrong-key")
        with VLLMEngine([front.url], "policy", api_key_env="AGENTRL_TEST_VLLM_KEY") as client:
            assert client.health() == {front.url: True}  # /health is not guarded (vLLM)
            with pytest.raises(VLLMEngineError, match="HTTP 401: Unauthorized") as info:
                client.generate([[4, 5, 6]], params)
            assert info.value.status == 401 and client.retries == 0
            assert "sk-" not in str(info.value)
    finally:
        front.shutdown()


def test_timeouts_are_retried_then_reported():
    silent = serving.SilentServer()
    try:
        with VLLMEngine([silent.url], "policy", timeout_s=0.3, max_retries=1,
                        backoff_s=0.01) as client:
            start = time.monotonic()
            with pytest.raises(VLLMEngineError, match=r"timed out after 0\.3 s") as info:
                client.generate([[1]], SamplingParams(max_new_tokens=2))
            assert time.monotonic() - start < 10
            assert info.value.servers == (silent.url,) and client.retries == 1
    finally:
        silent.close()


def test_client_errors_fail_at_once(engine, servers):
    sent = sum(completions_served(s) for s in servers)
    with pytest.raises(VLLMEngineError, match="rejected by") as info:
        engine.generate([[1, 2], [1, 10**9]], SamplingParams(max_new_tokens=2))
    assert info.value.index == 1 and info.value.status == 400
    assert "out of vocabulary" in str(info.value)
    assert sum(completions_served(s) for s in servers) - sent <= 2  # no retries
    assert engine.retries == 0


def test_wait_until_ready_health_and_max_model_len(engine, servers):
    assert engine.wait_until_ready(timeout_s=30) == {s.url: 4096 for s in servers}
    assert engine.max_model_len == 4096
    assert engine._body([1] * 10, SamplingParams(max_new_tokens=10_000))["max_tokens"] == 4086
    with pytest.raises(ValueError, match="max_model_len=4096"):
        engine.generate([[1] * 4096], SamplingParams())
    dead = serving.closed_port_url()
    with VLLMEngine([servers[0].url, dead], "policy") as client:
        assert client.health() == {servers[0].url: True, dead: False}
        with pytest.raises(VLLMEngineError, match="not ready") as info:
            client.wait_until_ready(timeout_s=0.3, poll_s=0.1)
        assert info.value.servers == (dead,)
    with VLLMEngine([servers[0].url], "other-model") as client, pytest.raises(
            VLLMEngineError, match="serves \\['policy'\\], not 'other-model'"):
        client.wait_until_ready(timeout_s=0.2, poll_s=0.1)


def test_sync_weights_reloads_every_server(engine, servers, tmp_path):
    prompt, params = [[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(prompt, params)[0].token_ids
    config = serving.backend().config
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    try:
        path = engine.sync_weights(Policy(config, serving.perturbed_params(seed=3)),
                                   serving.workdir() / "sync-full", tokenizer_dir=tmp_path)
        assert (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()
        assert engine.policy_version == 1
        after = engine.generate(prompt, params)[0].token_ids
        assert after != before and after == direct(prompt, [params])[0].token_ids
        assert serving.backend().model_path == str(path)
        for front in servers:
            assert front.request_counts["/collective_rpc"] >= 2
            assert front.request_counts["/reset_prefix_cache"] >= 1
        # Bare parameters work too, given their config.
        engine.sync_weights(serving.original_params(), serving.workdir() / "sync-params",
                            config=config)
        assert engine.generate(prompt, params)[0].token_ids == before
        with pytest.raises(ValueError, match="config="):
            engine.sync_weights(serving.original_params(), serving.workdir() / "sync-bad")
    finally:
        serving.restore()
    assert engine.generate(prompt, params)[0].token_ids == before


def test_sync_weights_names_the_server_that_failed(servers):
    dead = serving.closed_port_url()
    try:
        with VLLMEngine([servers[0].url, dead], "policy", max_retries=1, backoff_s=0.01
                        ) as client, pytest.raises(VLLMEngineError) as info:
            client.sync_weights(serving.original_params(), serving.workdir() / "sync-fail",
                                config=serving.backend().config)
        assert info.value.servers == (dead,)
        message = str(info.value)
        assert "1 of 2 server(s)" in message and f"{dead}: update_config" in message
        assert client.policy_version == 0
    finally:
        serving.restore()


def test_sync_lora_serves_the_adapter_by_name(engine, servers):
    backend = serving.backend()
    prompt, params = [[2, 7, 1, 8]], SamplingParams(temperature=0.0, max_new_tokens=5)
    base = engine.generate(prompt, params)[0].token_ids
    spec, adapters = serving.random_adapters(seed=1)
    try:
        path = engine.sync_lora(adapters, spec, backend.config, serving.workdir() / "lora-1",
                                "policy-lora-1")
        assert (path / "adapter_config.json").is_file()
        assert engine.model == "policy-lora-1" and engine.policy_version == 1
        tuned = engine.generate(prompt, params)[0].token_ids
        assert tuned != base
        assert tuned == direct(prompt, [params], model="policy-lora-1")[0].token_ids
        spec2, adapters2 = serving.random_adapters(seed=2)
        engine.sync_lora(adapters2, spec2, backend.config, serving.workdir() / "lora-2",
                         "policy-lora-2")
        served = [m["id"] for m in engine_models(servers[0])]
        assert served == ["policy", "policy-lora-2"]  # the previous adapter was unloaded
        assert engine.generate(prompt, params)[0].token_ids == direct(
            prompt, [params], model="policy-lora-2")[0].token_ids
        # Re-syncing under the same name replaces the adapter (unload + load).
        unloads = servers[0].request_counts.get("/v1/unload_lora_adapter", 0)
        engine.sync_lora(adapters, spec, backend.config, serving.workdir() / "lora-2b",
                         "policy-lora-2")
        assert engine.generate(prompt, params)[0].token_ids == tuned
        # (Both test servers share one backend, so their unload/load calls interleave.)
        assert servers[0].request_counts["/v1/unload_lora_adapter"] > unloads
        assert [m["id"] for m in engine_models(servers[1])] == ["policy", "policy-lora-2"]
    finally:
        for name in list(backend._adapters):
            backend.unload_lora(name)
    for front in servers:
        assert front.request_counts["/v1/load_lora_adapter"] >= 3


def test_constructor_and_call_validation(monkeypatch, servers):
    with pytest.raises(ValueError, match="http"):
        VLLMEngine(["gpu-node:8000"], "policy")
    with pytest.raises(ValueError, match="twice"):
        VLLMEngine(["http://a:1/v1", "http://a:1"], "policy")
    monkeypatch.delenv("AGENTRL_UNSET_KEY", raising=False)
    with pytest.raises(ValueError, match="AGENTRL_UNSET_KEY"):
        VLLMEngine(["http://a:1"], "policy", api_key_env="AGENTRL_UNSET_KEY")
    with VLLMEngine([servers[0].url + "/v1/"], "policy") as client:
        assert client.servers[0].url == servers[0].url
        with pytest.raises(ValueError, match="prompt 1 is empty"):
            client.generate([[1], []], SamplingParams())
        with pytest.raises(ValueError, match="sticky_keys"):
            client.generate([[1]], SamplingParams(), sticky_keys=["a", "b"])
        with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
            client.generate([[1], [2]], [SamplingParams()] * 3)
