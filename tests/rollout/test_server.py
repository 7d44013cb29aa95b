"""`agentrl serve`: vLLM's OpenAI-compatible protocol over `JaxEngine`, for real over HTTP.

One tiny random Qwen2 checkpoint is served (tests/rollout/serving.py); every
answer is checked against `JaxEngine.generate` on the same parameters.
"""

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from agentrl.envs.chat_client import ChatClient
from agentrl.models import Policy, chat
from agentrl.models.lora import join_lora, save_peft_adapter
from agentrl.rollout.engine import SamplingParams
from agentrl.rollout.server import (
    OpenAIServer,
    assistant_message,
    finish_choice,
    parse_sampling,
    sample_seed,
)
from tests.rollout import serving

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    front = OpenAIServer(serving.backend(), port=0, max_wait_ms=5).start()
    yield front
    front.shutdown()


def request(url, path, body=None, *, raw=None, method=None):
    """`(status, decoded JSON or text)` of one HTTP request."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or (
        "POST" if data is not None else "GET"), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


def direct(prompts, params, model=serving.SERVED):
    """`JaxEngine.generate` on the served parameters, bypassing HTTP."""
    return serving.backend().generate(model, [list(p) for p in prompts], list(params))


def greedy(budget, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=budget, **kw)


# ---------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------


def test_token_prompts_n_and_seed_match_the_engine(server):
    prompts = [[11, 22, 33], [7, 8, 9, 10, 11], [5]]
    status, out = request(server.url, "/v1/completions", {
        "model": "policy", "prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0.8,
        "top_p": 0.9, "top_k": 50, "seed": 1234, "logprobs": 0, "ignore_eos": True,
        "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert status == 200, out
    assert out["object"] == "text_completion" and out["model"] == "policy"
    choices = out["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    expected = direct(
        [p for p in prompts for _ in range(2)],
        [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=6,
                        seed=sample_seed(1234, j)) for _ in prompts for j in range(2)])
    for k, (choice, want) in enumerate(zip(choices, expected, strict=True)):
        assert choice["prompt_token_ids"] == prompts[k // 2]
        assert choice["token_ids"] == want.token_ids
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want.token_ids]
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want.logprobs, atol=1e-5)
        assert all(lp < 0 for lp in choice["logprobs"]["token_logprobs"])
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    # The n samples of a seeded prompt differ; the seed makes them reproducible.
    assert choices[0]["token_ids"] != choices[1]["token_ids"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == 9 and usage["completion_tokens"] == 36
    assert usage["total_tokens"] == 45


def test_text_prompt_detokenised_text_and_stop_token(server):
    tokenizer = serving.backend().tokenizer
    status, out = request(server.url, "/v1/completions", {
        "model": "policy", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0, "logprobs": 0, "return_token_ids": True})
    assert status == 200, out
    choice = out["choices"][0]
    prompt_ids = tokenizer.encode("The capital of France is")
    assert choice["prompt_token_ids"] == prompt_ids
    want = direct([prompt_ids], [greedy(8, stop_token_ids=tokenizer.stop_token_ids)])[0]
    assert choice["token_ids"] == want.token_ids
    assert choice["logprobs"]["token_logprobs"] == [0.0] * 8  # greedy: 0 (Engine protocol)
    assert choice["logprobs"]["tokens"] == [serving.backend().token_text(t, False)
                                            for t in want.token_ids]
    assert choice["text"] == serving.backend().decode(want.token_ids, True)
    # Stop on the 3rd generated token: it ends the completion, stays in the ids, and its
    # text is left out unless include_stop_str_in_output.
    stop = want.token_ids[2]
    cut = want.token_ids.index(stop) + 1
    for include in (False, True):
        status, out = request(server.url, "/v1/completions", {
            "prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop],
            "return_token_ids": True, "include_stop_str_in_output": include,
            "skip_special_tokens": False})
        choice = out["choices"][0]
        assert choice["token_ids"] == want.token_ids[:cut]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        text_ids = want.token_ids[:cut] if include else want.token_ids[:cut - 1]
        assert choice["text"] == serving.backend().decode(text_ids, False)


def test_stop_strings_cut_text_and_ids():
    backend = serving.backend()
    tokenizer = backend.tokenizer
    ids = tokenizer.encode(" alpha beta gamma delta")
    completion = type("C", (), {"token_ids": ids, "logprobs": [-1.0] * len(ids),
                                "finish_reason": "length"})()
    sampling = parse_sampling({"stop": ["gamma"]}, chat_request=False)
    choice = finish_choice(backend, completion, sampling)
    assert choice.text == " alpha beta "
    assert (choice.finish_reason, choice.stop_reason) == ("stop", "gamma")
    assert tokenizer.decode(choice.token_ids).endswith("gamma")  # ids up to the string's end
    assert len(choice.logprobs) == len(choice.token_ids) < len(ids)
    sampling = parse_sampling({"stop": "beta", "include_stop_str_in_output": True},
                              chat_request=False)
    assert finish_choice(backend, completion, sampling).text == " alpha beta"


# ---------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------


def test_chat_client_gets_the_engines_reply(server):
    backend = serving.backend()
    messages = [{"role": "user", "content": "Say hi."}]
    client = ChatClient(server.url, "policy", timeout_s=60)
    replies = client.chat(messages, temperature=0.0, max_tokens=10, n=2)
    prompt = chat.encode_messages(backend.tokenizer, messages, add_generation_prompt=True)
    want = direct([prompt], [greedy(10, stop_token_ids=backend.tokenizer.stop_token_ids)])[0]
    text_ids = want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids
    assert replies == [backend.decode(text_ids, True)] * 2
    assert client.stats.completion_tokens == 2 * len(want.token_ids)
    # Token ids and the rendered prompt come back the vLLM way.
    status, out = request(server.url, "/v1/chat/completions", {
        "model": "policy", "messages": messages, "max_tokens": 10, "temperature": 0,
        "return_token_ids": True, "logprobs": True})
    assert status == 200, out
    assert out["object"] == "chat.completion" and out["prompt_token_ids"] == prompt
    choice = out["choices"][0]
    assert choice["token_ids"] == want.token_ids
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [0.0] * len(want.token_ids)
    assert choice["message"]["role"] == "assistant"


def test_assistant_message_parses_hermes_tool_calls_and_reasoning():
    text = ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n'
            "</tool_call>")
    message, finish = assistant_message(text)
    assert finish == "tool_calls"
    assert message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"query": "Paris"}
    message, finish = assistant_message("<think>\nhmm\n</think>\n\nThe answer is 4.")
    assert finish is None and message["tool_calls"] == []
    assert (message["content"], message["reasoning_content"]) == ("The answer is 4.", "hmm")
    message, finish = assistant_message(text, parse_tools=False)  # tool_choice="none"
    assert finish is None and message["content"] == text
    assert assistant_message("plain")[0]["content"] == "plain"


# ---------------------------------------------------------------------------
# /v1/models, /health, errors
# ---------------------------------------------------------------------------


def test_models_and_health(server):
    status, body = request(server.url, "/health")
    assert (status, body) == (200, None)
    status, models = request(server.url, "/v1/models")
    assert status == 200 and models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == "policy" and card["max_model_len"] == 4096
    assert card["root"] == str(serving.checkpoint().resolve())


MALFORMED = [
    ("/v1/completions", {"model": "policy"}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "x", 3]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1], "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": [1], "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": [1], "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": [1], "stream": True}, 400, "stream"),
    ("/v1/completions", {"prompt": [1], "logprobs": 5}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [1], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": [1], "stop_token_ids": [1, "2"]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1], "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": [1], "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"model": "policy"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": "x"},
     400, "tools"),
    ("/v1/load_lora_adapter", {"lora_name": "a"}, 400, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
    ("/collective_rpc", {"method": "sleep"}, 400, "method"),
    ("/collective_rpc", {"method": "update_config", "kwargs": {"overrides": {
        "model_config": {"model": "/does/not/exist"}}}}, 400, "overrides.model_config.model"),
]


@pytest.mark.parametrize(("path", "body", "code", "param"), MALFORMED)
def test_malformed_requests_get_openai_errors(server, path, body, code, param):
    status, out = request(server.url, path, body)
    assert status == code, out
    error = out["error"]
    assert error["param"] == param and error["code"] == code
    assert error["type"] == ("BadRequestError" if code == 400 else "NotFoundError")
    assert param.split(".")[-1] in error["message"] or code == 404


def test_unparseable_bodies_and_unknown_routes(server):
    status, out = request(server.url, "/v1/completions", raw=b"{not json")
    assert status == 400 and "JSON decode error" in out["error"]["message"]
    status, out = request(server.url, "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in out["error"]["message"]
    status, out = request(server.url, "/v1/embeddings", {"input": "x"})
    assert status == 404 and out["error"]["type"] == "NotFoundError"


# ---------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------


def test_concurrent_requests_share_engine_calls():
    front = OpenAIServer(serving.backend(), port=0, max_wait_ms=500).start()
    try:
        prompts = [[100 + i, 200 + i, 300 + i] for i in range(6)]
        barrier, results = threading.Barrier(len(prompts)), [None] * len(prompts)

        def send(i):
            barrier.wait()
            results[i] = request(front.url, "/v1/completions", {
                "prompt": prompts[i], "max_tokens": 5, "seed": i, "logprobs": 0,
                "ignore_eos": True, "return_token_ids": True})

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        want = direct(prompts, [SamplingParams(max_new_tokens=5, seed=i) for i in range(6)])
        for (status, out), expected in zip(results, want, strict=True):
            assert status == 200
            assert out["choices"][0]["token_ids"] == expected.token_ids
        sizes = front.batcher.batch_sizes
        assert sum(sizes) == 6 and len(sizes) < 6 and max(sizes) > 1, sizes
    finally:
        front.shutdown()


# ---------------------------------------------------------------------------
# Weight updates
# ---------------------------------------------------------------------------


def reload(url, path):
    status, out = request(url, "/collective_rpc", {
        "method": "update_config",
        "kwargs": {"overrides": {"model_config": {"model": str(path)},
                                 "load_config": {"load_format": "auto"}}}})
    assert (status, out) == (200, {"results": [None]}), out
    status, out = request(url, "/collective_rpc", {"method": "reload_weights"})
    assert (status, out) == (200, {"results": [None]}), out
    assert request(url, "/reset_prefix_cache", method="POST")[0] == 200


def test_reload_weights_from_a_checkpoint_directory(server):
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = request(server.url, "/v1/completions", body)[1]["choices"][0]["token_ids"]
    other = serving.perturbed_checkpoint("reload-test")
    version = serving.backend().engine.policy_version
    reload(server.url, other)
    try:
        after = request(server.url, "/v1/completions", body)[1]["choices"][0]["token_ids"]
        assert after != before
        assert after == direct([[1, 2, 3, 4]], [greedy(6)])[0].token_ids
        assert serving.backend().engine.policy_version == version + 1
        assert request(server.url, "/v1/models")[1]["data"][0]["root"] == str(other)
    finally:
        reload(server.url, serving.checkpoint())
    assert serving.backend().model_path == str(serving.checkpoint())
    assert request(server.url, "/v1/completions", body)[1]["choices"][0]["token_ids"] == before


def test_lora_adapter_load_serve_unload(server):
    backend = serving.backend()
    spec, adapters = serving.random_adapters()
    path = save_peft_adapter(serving.workdir() / "lora-server", adapters, spec, backend.config)
    status, text = request(server.url, "/v1/load_lora_adapter",
                           {"lora_name": "adapter", "lora_path": str(path)})
    assert (status, text) == (200, "Success: LoRA adapter 'adapter' added successfully.")
    try:
        cards = request(server.url, "/v1/models")[1]["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("policy", None),
                                                           ("adapter", "policy")]
        prompt = [3, 1, 4, 1, 5]
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        base_ids = request(server.url, "/v1/completions", body)[1]["choices"][0]["token_ids"]
        lora_ids = request(server.url, "/v1/completions", {**body, "model": "adapter"}
                           )[1]["choices"][0]["token_ids"]
        assert lora_ids != base_ids
        # Greedy under the adapter = argmax of the LoRA model's logits (teacher forcing).
        policy = Policy(backend.config, join_lora(backend.base_params, adapters), lora=spec)
        logits = np.asarray(policy.logits(np.asarray([prompt + lora_ids[:-1]])))[0]
        assert list(logits[len(prompt) - 1:].argmax(-1)) == lora_ids
        status, out = request(server.url, "/v1/load_lora_adapter",
                              {"lora_name": "adapter", "lora_path": str(path)})
        assert status == 400 and "already been loaded" in out["error"]["message"]
        status, _ = request(server.url, "/v1/load_lora_adapter",
                            {"lora_name": "adapter", "lora_path": str(path),
                             "load_inplace": True})
        assert status == 200
    finally:
        status, text = request(server.url, "/v1/unload_lora_adapter", {"lora_name": "adapter"})
    assert (status, text) == (200, "Success: LoRA adapter 'adapter' removed successfully.")
    status, out = request(server.url, "/v1/completions", {"prompt": [1], "model": "adapter"})
    assert status == 404 and out["error"]["param"] == "model"


# ---------------------------------------------------------------------------
# The CLI, as a process
# ---------------------------------------------------------------------------


def test_agentrl_serve_subprocess_starts_serves_and_stops():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve", "--model", str(serving.checkpoint()),
         "--port", "0", "--served-model-name", "sub", "--max-batch-size", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout],
                     daemon=True).start()
    try:
        output, url = [], None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert process.poll() is None, "".join(output)
                continue
            output.append(line)
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].split()[0]
        assert url is not None and url.startswith("http://127.0.0.1:"), "".join(output)
        assert request(url, "/health") == (200, None)
        assert request(url, "/v1/models")[1]["data"][0]["id"] == "sub"
        status, out = request(url, "/v1/completions", {
            "model": "sub", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert status == 200
        assert out["choices"][0]["token_ids"] == direct([[1, 2, 3]], [greedy(3)])[0].token_ids
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        time.sleep(0.2)
        while not lines.empty():
            output.append(lines.get())
        assert "agentrl serve: shutting down" in "".join(output)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_refuses_an_unknown_model(capsys):
    from agentrl import cli

    assert cli.main(["serve", "--model", "no-such-model-or-dir", "--port", "0"]) == 1
    assert "neither a checkpoint directory nor a preset" in capsys.readouterr().err


def test_judges_run_against_agentrl_serve(server):
    """CM2's checklist judge and PORTool's evaluator over real HTTP to our server.

    The served model is random, so its replies are not verdict JSON: both
    judges must retry, count the parse failures, and return the documented
    defaults (item not satisfied; reward 0, unjudged) instead of raising.
    """
    from agentrl.envs.judges import ChecklistJudge, OutcomeEvaluator
    from tests.envs.test_judges import HERMES_TURN, ITEMS, STEP_0

    client = ChatClient(server.url, "policy", max_retries=0, timeout_s=120)
    judge = ChecklistJudge(client, batch_items=True, max_retries=1, max_tokens=8)
    assert judge.judge(ITEMS, STEP_0) == [False] * len(ITEMS)
    stats = judge.stats  # one batched request and one retry; every item fails to parse in each
    assert (stats.requests, stats.replies, stats.client_errors) == (2, 2, 0)
    assert stats.parse_failures == 2 * len(ITEMS) and stats.defaulted_votes == len(ITEMS)
    evaluator = OutcomeEvaluator(client, max_retries=1, max_tokens=8)
    result = evaluator.evaluate("Where is the Eiffel Tower?", HERMES_TURN[1:])
    assert (result.reward, result.label) == (0.0, None)
    assert evaluator.stats.requests == 2 and evaluator.stats.parse_failures == 2
    assert evaluator.stats.unjudged == 1
