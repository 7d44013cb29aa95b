"""`agentrl serve`: an OpenAI-compatible HTTP server over `JaxEngine`, speaking vLLM's protocol.

    agentrl serve --model /ckpt/Qwen2.5-0.5B-Instruct --port 8000
    agentrl serve --model tiny --served-model-name policy --port 0     # random tiny model

vLLM cannot run on a CPU-only machine, so `VLLMEngine` (the client of real
vLLM servers) is tested against this server, which implements the subset of
vLLM 0.11's OpenAI-compatible protocol that agentrl uses, field for field:

* `POST /v1/completions`: token-id prompts (`list[int]` or `list[list[int]]`)
  or text prompts (`str` or `list[str]`), `n`, `max_tokens`, `temperature`,
  `top_p`, `top_k`, `seed`, `stop_token_ids`, `ignore_eos`, `stop` strings,
  `logprobs=0` (the log-probability of each sampled token under the
  sampling distribution: after temperature, top-k and top-p, as vLLM's
  `--logprobs-mode processed_logprobs`), `return_tokens_as_token_ids`
  (`logprobs.tokens` as `"token_id:123"`), `return_token_ids`
  (`choices[i].token_ids`, `choices[i].prompt_token_ids`),
  `skip_special_tokens`, `include_stop_str_in_output`.
* `POST /v1/chat/completions`: `messages`, `tools`, `tool_choice`
  (`"auto"` / `"none"`), `n`, `max_tokens` (or `max_completion_tokens`),
  `temperature`, `top_p`, `top_k`, `seed`, `stop`, `stop_token_ids`,
  `logprobs`, `return_token_ids`, `chat_template_kwargs.enable_thinking`;
  the dialogue is rendered with Qwen's chat template
  (`agentrl.models.chat`), Hermes tool calls are parsed into `tool_calls`
  (what vLLM does with `--enable-auto-tool-choice --tool-call-parser hermes`)
  and Qwen3 reasoning into `reasoning_content`.
* `GET /v1/models`, `GET /health`.
* Weight updates, as vLLM has them: `POST /collective_rpc` with
  `{"method": "update_config", "kwargs": {"overrides": {"model_config":
  {"model": DIR}}}}` then `{"method": "reload_weights"}` loads an HF
  checkpoint directory (`load_pretrained` → `JaxEngine.update_params`);
  `POST /reset_prefix_cache` (a no-op: the JAX engine keeps no prefix cache);
  `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`, `load_inplace`) /
  `POST /v1/unload_lora_adapter` (`lora_name`) serve PEFT adapters under
  their own model name. Unlike vLLM, these need no environment variable
  (vLLM: `VLLM_SERVER_DEV_MODE=1`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).

Errors are vLLM's JSON shape, `{"error": {"message", "type", "param",
"code"}}`: HTTP 400 for a malformed request (the message names the field,
the value and the fix), 404 for an unknown model or adapter.

Concurrent requests are batched: a `RequestBatcher` thread takes the first
waiting request, collects the others that arrive within `max_wait_ms`, and
runs them as one `JaxEngine.generate` call (per served model), so throughput
grows with concurrency as it does with vLLM's continuous batching.

The server binds 127.0.0.1 unless `--host` says otherwise. `--api-key` guards
the `/v1/*` routes as vLLM's does; the weight and adapter routes load any
directory the server can read, so do not expose it beyond a trusted network.
"""

import concurrent.futures
import dataclasses
import hmac
import http.server
import json
import logging
import pathlib
import queue
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentrl.rollout.engine import Completion, SamplingParams

logger = logging.getLogger(__name__)

VLLM_PROTOCOL_VERSION = "0.11"
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions
_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio stride: distinct seeds for the n samples

# Control tokens dropped by `skip_special_tokens` ("special": true in Qwen's
# tokenizer_config.json). `<tool_call>`, `<think>`, the FIM and repo tokens are
# added tokens but not special: they stay in the text, as with vLLM.
_CONTROL_TOKEN = re.compile(r"^<\|(?!fim_|repo_name|file_sep).*\|>$")


# ---------------------------------------------------------------------------
# Errors in vLLM's shape.
# ---------------------------------------------------------------------------


class OpenAIError(Exception):
    """A request error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 error_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type or {400: "BadRequestError", 404: "NotFoundError"}.get(
            status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.status}}


def _bad(param: str, value: Any, expected: str) -> OpenAIError:
    shown = json.dumps(value)[:120] if _is_json(value) else repr(value)[:120]
    return OpenAIError(f"'{param}' must be {expected}, got {shown}.", param=param)


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------
# Field readers: None reads as the default (vLLM's pydantic models do the same).
# ---------------------------------------------------------------------------


def _int(body: Mapping, name: str, default: int | None, *, minimum: int | None = None,
         maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, value, "an integer")
    if minimum is not None and value < minimum:
        raise _bad(name, value, f"an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise _bad(name, value, f"an integer <= {maximum}")
    return value


def _float(body: Mapping, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, value, "a number")
    return float(value)


def _bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, value, "true or false")
    return value


def _id_list(body: Mapping, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _bad(name, value, "a list of integer token ids")
    return list(value)


def _stop_strings(body: Mapping) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _bad("stop", value, "a non-empty string or a list of non-empty strings")
    return value


# Sampling features vLLM has and this server does not: accepted only at their
# neutral value, so a request that relies on one fails loudly instead of being
# served with different semantics.
_NEUTRAL = {
    "stream": (False, "streaming is not supported; send stream=false"),
    "echo": (False, "echo is not supported; the prompt ids come back with return_token_ids"),
    "suffix": (None, "suffix is not supported"),
    "presence_penalty": (0.0, "penalties are not supported; send 0 (they change the sampling "
                              "distribution the trainer's importance ratio assumes)"),
    "frequency_penalty": (0.0, "penalties are not supported; send 0"),
    "repetition_penalty": (1.0, "repetition_penalty is not supported; send 1.0"),
    "min_p": (0.0, "min_p is not supported; send 0"),
    "min_tokens": (0, "min_tokens is not supported; send 0"),
    "use_beam_search": (False, "beam search is not supported"),
    "logit_bias": (None, "logit_bias is not supported"),
    "allowed_token_ids": (None, "allowed_token_ids is not supported"),
    "bad_words": (None, "bad_words is not supported"),
    "prompt_logprobs": (None, "prompt_logprobs is not supported"),
    "response_format": (None, "structured outputs are not supported"),
    "structured_outputs": (None, "structured outputs are not supported"),
    "guided_json": (None, "guided decoding is not supported"),
    "guided_regex": (None, "guided decoding is not supported"),
    "guided_choice": (None, "guided decoding is not supported"),
    "continue_final_message": (False, "continue_final_message is not supported"),
}


def _check_neutral(body: Mapping) -> None:
    for name, (neutral, why) in _NEUTRAL.items():
        value = body.get(name)
        if value is None or value == neutral or value in ([], {}):
            continue
        raise OpenAIError(f"'{name}'={json.dumps(value)[:80]}: {why}.", param=name)


# ---------------------------------------------------------------------------
# Requests: what to generate, and how to write the answer.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Sampling:
    """The sampling fields of one request (shared by its prompts)."""

    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    stop: list[str]
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    return_tokens_as_token_ids: bool
    return_token_ids: bool


def parse_sampling(body: Mapping, *, chat_request: bool) -> Sampling:
    """Validates the sampling fields shared by both endpoints (OpenAIError on a bad one)."""
    _check_neutral(body)
    max_tokens = _int(body, "max_tokens", None, minimum=1)
    if chat_request:
        max_tokens = _int(body, "max_completion_tokens", max_tokens, minimum=1)
    elif max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    temperature = _float(body, "temperature", 1.0)
    if temperature < 0:
        raise _bad("temperature", temperature, "a number >= 0 (0 is greedy)")
    top_p = _float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad("top_p", top_p, "a number in (0, 1]")
    top_k = _int(body, "top_k", 0, minimum=-1)
    best_of = _int(body, "best_of", None, minimum=1)
    n = _int(body, "n", 1, minimum=1, maximum=128)
    if best_of is not None and best_of != n:
        raise _bad("best_of", best_of, f"equal to n={n} (best_of sampling is not supported)")
    seed = _int(body, "seed", None, minimum=-(2**63), maximum=2**64 - 1)
    return Sampling(
        n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=max(top_k, 0), seed=seed, stop_token_ids=_id_list(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos", False), stop=_stop_strings(body),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False),
        return_token_ids=_bool(body, "return_token_ids", False),
    )


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` of a request seeded `seed` (sample 0 keeps it)."""
    if seed is None:
        return None
    return (seed + sample * _SEED_STRIDE) % 2**64


def parse_completion_prompts(prompt: Any) -> list[list[int] | str]:
    """`prompt` of /v1/completions as a list of prompts (token-id lists or strings)."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise _bad("prompt", prompt, "a string, a list of strings, a list of token ids or a "
                   "list of token-id lists (non-empty)")
    for index, item in enumerate(prompts):
        ok = (isinstance(item, str) and item) or (isinstance(item, list) and item and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item))
        if not ok:
            raise OpenAIError(
                f"'prompt'[{index}] must be a non-empty string or a non-empty list of integer "
                f"token ids, got {json.dumps(item)[:80]}.", param="prompt")
    return prompts


# ---------------------------------------------------------------------------
# The generation backend: engine, tokenizer, adapters, weight reloads.
# ---------------------------------------------------------------------------


class GenerationBackend:
    """A `JaxEngine` plus what serving needs: tokenizer, model names, LoRA adapters, reloads.

    Every engine call and parameter swap holds `lock`, so a weight update
    never lands in the middle of a generation. LoRA adapters are kept as PEFT
    matrices and merged into a copy of the base parameters when first used
    (and again after a base-weight reload, as vLLM applies adapters to the
    current base).
    """

    def __init__(self, engine, tokenizer, served_model_name: str, *,
                 model_path: str | None = None):
        from agentrl.models import chat

        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.flavour = chat.chat_flavour(tokenizer)
        self.config = engine.config
        self.lock = threading.Lock()
        self.base_params = engine.params
        self.base_version = 0
        self._loaded = served_model_name  # whose parameters the engine holds
        self._adapters: dict[str, dict[str, Any]] = {}
        self._pending_model_path: str | None = None
        self._control_ids = frozenset(
            i for token, i in tokenizer.special_tokens.items() if _CONTROL_TOKEN.match(token))
        if tokenizer.vocab_size > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but the model's "
                f"vocab_size is {self.config.vocab_size}; pass the model's own tokenizer "
                "(--tokenizer).")

    # -- models --------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_total_length

    def model_cards(self) -> list[dict[str, Any]]:
        created = int(time.time())
        cards = [{"id": self.served_model_name, "object": "model", "created": created,
                  "owned_by": "agentrl", "root": self.model_path or self.served_model_name,
                  "parent": None, "max_model_len": self.max_model_len, "permission": []}]
        for name, adapter in list(self._adapters.items()):
            cards.append({"id": name, "object": "model", "created": created,
                          "owned_by": "agentrl", "root": adapter["path"],
                          "parent": self.served_model_name, "max_model_len": self.max_model_len,
                          "permission": []})
        return cards

    def resolve_model(self, model: Any) -> str:
        if model is None or model == self.served_model_name:
            return self.served_model_name
        if isinstance(model, str) and model in self._adapters:
            return model
        names = [self.served_model_name, *list(self._adapters)]
        raise OpenAIError(f"The model `{model}` does not exist. Served models: {names}.",
                          param="model", status=404)

    # -- generation ----------------------------------------------------------

    def check_prompt(self, ids: Sequence[int], max_tokens: int | None, index: int) -> int:
        """Validates one prompt; returns its token budget (vLLM's 400s, same messages)."""
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                f"prompt {index}: token id {bad[0]} is out of vocabulary [0, {vocab}); encode "
                "prompts with the served model's tokenizer.", param="prompt")
        room = self.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        if room < 1 or max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion (max_tokens).", param="max_tokens")
        return max_tokens

    def check_stop_ids(self, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise OpenAIError(
                f"stop_token_ids {bad} are out of vocabulary [0, {self.config.vocab_size}).",
                param="stop_token_ids")

    def stop_ids(self, sampling: Sampling) -> tuple[int, ...]:
        """The request's stop ids, plus the tokenizer's EOS ids unless `ignore_eos` (vLLM)."""
        ids = list(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            ids += [t for t in self.tokenizer.stop_token_ids if t not in ids]
        return tuple(ids)

    def generate(self, model: str, prompts: list[list[int]],
                 params: list[SamplingParams]) -> list[Completion]:
        """One engine call for `model` (the base or an adapter), under the lock."""
        with self.lock:
            if model != self.served_model_name and model not in self._adapters:
                raise OpenAIError(f"The model `{model}` does not exist (its LoRA adapter was "
                                  "unloaded).", param="model", status=404)
            self._use(model)
            return self.engine.generate(prompts, params)

    def _use(self, model: str) -> None:
        if self._loaded == model:
            return
        if model == self.served_model_name:
            params = self.base_params
        else:
            params = self._adapter_params(model)
        self.engine.update_params(params, version=self.engine.policy_version)
        self._loaded = model

    def _adapter_params(self, name: str):
        from agentrl.models.lora import join_lora, merge_lora

        adapter = self._adapters[name]
        if adapter.get("base_version") != self.base_version:
            merged = merge_lora(join_lora(self.base_params, adapter["matrices"]), adapter["spec"])
            adapter["params"], adapter["base_version"] = merged, self.base_version
        return adapter["params"]

    # -- LoRA ----------------------------------------------------------------

    def load_lora(self, name: Any, path: Any, load_inplace: bool) -> str:
        from agentrl.models.lora import load_peft_adapter

        if not isinstance(name, str) or not name:
            raise _bad("lora_name", name, "a non-empty string")
        if not isinstance(path, str) or not path:
            raise _bad("lora_path", path, "a non-empty string (a PEFT adapter directory)")
        if name == self.served_model_name:
            raise OpenAIError(f"The lora adapter name '{name}' conflicts with the served base "
                              "model; choose another lora_name.", param="lora_name",
                              error_type="InvalidUserInput")
        if name in self._adapters and not load_inplace:
            raise OpenAIError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.", param="lora_name",
                error_type="InvalidUserInput")
        if not pathlib.Path(path).is_dir():
            raise OpenAIError(f"No adapter found for {path}: not a directory on this server.",
                              param="lora_path", status=404)
        try:
            spec, matrices = load_peft_adapter(path, self.config)
        except (FileNotFoundError, KeyError, ValueError) as error:
            raise OpenAIError(f"Cannot load the LoRA adapter at {path}: {error}",
                              param="lora_path") from error
        with self.lock:
            self._adapters[name] = {"path": path, "spec": spec, "matrices": matrices}
            if self._loaded == name:  # reloaded in place: re-merge on next use
                self._loaded = None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora(self, name: Any) -> str:
        if not isinstance(name, str) or name not in self._adapters:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              status=404)
        with self.lock:
            del self._adapters[name]
            if self._loaded == name:
                self._loaded = None
        return f"Success: LoRA adapter '{name}' removed successfully."

    # -- full weights (vLLM's collective_rpc update_config + reload_weights) ---

    def update_config(self, overrides: Any) -> None:
        if not isinstance(overrides, Mapping):
            raise _bad("kwargs.overrides", overrides, "an object such as "
                       '{"model_config": {"model": "/path/to/checkpoint"}}')
        unknown = sorted(set(overrides) - {"model_config", "load_config"})
        if unknown:
            raise OpenAIError(f"update_config: configs {unknown} are not supported; use "
                              "model_config and load_config (as vLLM's model runner).",
                              param="overrides")
        model_config = overrides.get("model_config") or {}
        if not isinstance(model_config, Mapping):
            raise _bad("overrides.model_config", model_config, "an object")
        extra = sorted(set(model_config) - {"model"})
        if extra:
            raise OpenAIError(f"update_config: model_config fields {extra} cannot change at run "
                              "time here; only 'model' (the checkpoint directory).",
                              param="overrides")
        if "model" in model_config:
            path = model_config["model"]
            if not isinstance(path, str) or not (pathlib.Path(path) / "config.json").is_file():
                raise _bad("overrides.model_config.model", path,
                           "an HF checkpoint directory on this server (with config.json)")
            self._pending_model_path = path

    def reload_weights(self) -> None:
        from agentrl.models import load_pretrained

        path = self._pending_model_path or self.model_path
        if path is None:
            raise OpenAIError(
                "reload_weights: the server was started from a preset, not a directory; first "
                "call update_config with {'model_config': {'model': DIR}}.", param="method")
        config = self.config
        try:
            policy = load_pretrained(
                path, dtype=config.dtype, mesh=self.engine.mesh, rules=self.engine.rules,
                param_dtype=config.param_dtype, remat=config.remat,
                scan_layers=config.scan_layers, attention_impl=config.attention_impl,
                logits_chunk_size=config.logits_chunk_size)
        except (FileNotFoundError, KeyError, ValueError, NotImplementedError) as error:
            raise OpenAIError(f"reload_weights: cannot load {path}: {error}",
                              param="method") from error
        differ = [f.name for f in dataclasses.fields(config)
                  if f.name not in ("bos_token_id", "eos_token_id")
                  and getattr(policy.config, f.name) != getattr(config, f.name)]
        if differ:
            raise OpenAIError(
                f"reload_weights: {path} has another architecture ({', '.join(differ)} differ "
                "from the served model); start a new server for a new architecture.",
                param="method")
        with self.lock:
            self.engine.update_params(policy.params)
            self.base_params = self.engine.params
            self.base_version += 1
            self._loaded = self.served_model_name
            self.model_path = path
            self._pending_model_path = None
        logger.info("reloaded weights from %s (policy_version %d)", path,
                    self.engine.policy_version)

    # -- text ----------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        size = self.tokenizer.vocab_size
        kept = [t for t in ids if t < size and not (skip_special_tokens and t in self._control_ids)]
        return self.tokenizer.decode(kept) if kept else ""

    def token_text(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token_id}"
        return self.decode([token_id], skip_special_tokens=False)


# ---------------------------------------------------------------------------
# Request batching.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    future: concurrent.futures.Future


class RequestBatcher:
    """Coalesces concurrent requests into one `run(model, prompts, params)` call per model.

    The worker thread takes the oldest waiting job, then every job that
    arrives within `max_wait_s` (up to `max_prompts` prompts), and runs them
    together. A batch that fails is retried job by job, so one bad request
    cannot fail the others.

    Attributes:
      calls: engine calls made.
      batch_sizes: requests (jobs) per call, in order.
    """

    def __init__(self, run: Callable[[str, list, list], list[Completion]], *,
                 max_wait_s: float = DEFAULT_MAX_WAIT_MS / 1000, max_prompts: int = 64):
        self._run = run
        self.max_wait_s = max_wait_s
        self.max_prompts = max_prompts
        self.calls = 0
        self.batch_sizes: list[int] = []
        self._queue: queue.Queue = queue.Queue()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="agentrl-batcher", daemon=True)
        self._thread.start()

    def submit(self, model: str, prompts: list[list[int]],
               params: list[SamplingParams]) -> list[Completion]:
        """Blocks until the job's completions are ready (re-raises the engine's error)."""
        if self._stopped:
            raise RuntimeError("the request batcher is stopped (the server is shutting down)")
        job = _Job(model, prompts, params, concurrent.futures.Future())
        self._queue.put(job)
        return job.future.result()

    def stop(self) -> None:
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs, size = [job], len(job.prompts)
            deadline = time.monotonic() + self.max_wait_s
            stop = False
            while size < self.max_prompts:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    more = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
                size += len(more.prompts)
            self._run_jobs(jobs)
            if stop:
                return

    def _run_jobs(self, jobs: list[_Job]) -> None:
        by_model: dict[str, list[_Job]] = {}
        for job in jobs:
            by_model.setdefault(job.model, []).append(job)
        for model, group in by_model.items():
            try:
                results = self._call(model, [p for j in group for p in j.prompts],
                                     [p for j in group for p in j.params], len(group))
            except Exception as error:
                if len(group) == 1:
                    group[0].future.set_exception(error)
                    continue
                for job in group:  # isolate the failing request
                    try:
                        job.future.set_result(self._call(model, job.prompts, job.params, 1))
                    except Exception as single_error:
                        job.future.set_exception(single_error)
                continue
            start = 0
            for job in group:
                job.future.set_result(results[start:start + len(job.prompts)])
                start += len(job.prompts)

    def _call(self, model, prompts, params, jobs: int) -> list[Completion]:
        self.calls += 1
        self.batch_sizes.append(jobs)
        return self._run(model, prompts, params)


# ---------------------------------------------------------------------------
# Endpoint logic (pure functions of the backend and the request body).
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Choice:
    """One finished sample, cut and detokenised as vLLM returns it."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None


def finish_choice(backend: GenerationBackend, completion: Completion, sampling: Sampling) -> Choice:
    """Applies stop strings and vLLM's detokenisation rules to one engine completion.

    * A stop token (request `stop_token_ids`, or EOS) stays in `token_ids`;
      its text is left out unless `include_stop_str_in_output`.
      `stop_reason` is the token id, None for EOS (vLLM).
    * A stop string ends the completion at the token that completes it: the
      ids up to that token are kept, the text is cut before the string
      (kept with `include_stop_str_in_output`), `stop_reason` is the string.
    """
    ids, logprobs = list(completion.token_ids), list(completion.logprobs)
    finish, stop_reason = completion.finish_reason, None
    text_ids = ids
    if finish == "stop" and ids:
        last = ids[-1]
        stop_reason = last if last in sampling.stop_token_ids else None
        if not sampling.include_stop_str_in_output:
            text_ids = ids[:-1]
    skip = sampling.skip_special_tokens
    text = backend.decode(text_ids, skip)
    hit = _first_stop(text, sampling.stop)
    if hit is not None:
        string, _ = hit
        low, high = 1, len(ids)  # smallest prefix whose text holds a stop string
        while low < high:
            middle = (low + high) // 2
            if _first_stop(backend.decode(ids[:middle], skip), sampling.stop) is not None:
                high = middle
            else:
                low = middle + 1
        ids, logprobs = ids[:low], logprobs[:low]
        prefix_text = backend.decode(ids, skip)
        string, position = _first_stop(prefix_text, sampling.stop)
        keep = position + (len(string) if sampling.include_stop_str_in_output else 0)
        text, finish, stop_reason = prefix_text[:keep], "stop", string
    return Choice(ids, logprobs, text, finish, stop_reason)


def _first_stop(text: str, stops: Sequence[str]) -> tuple[str, int] | None:
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    position, string = min(found)
    return string, position


def _engine_params(backend: GenerationBackend, sampling: Sampling, budgets: list[int]
                   ) -> list[list[SamplingParams]]:
    """Per prompt, the n `SamplingParams` of its samples."""
    stop_ids = backend.stop_ids(sampling)
    return [[SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k, max_new_tokens=budget,
                            stop_token_ids=stop_ids, seed=sample_seed(sampling.seed, j))
             for j in range(sampling.n)] for budget in budgets]


def _run(backend: GenerationBackend, submit, model: str, prompts: list[list[int]],
         params: list[list[SamplingParams]]) -> list[list[Completion]]:
    flat_prompts = [p for p, ps in zip(prompts, params, strict=True) for _ in ps]
    flat_params = [q for ps in params for q in ps]
    try:
        flat = submit(model, flat_prompts, flat_params)
    except ValueError as error:
        if not str(error).startswith("generate:"):
            raise  # not a request problem: a 500
        raise OpenAIError(str(error), param="prompt") from error  # JaxEngine's validation
    out, start = [], 0
    for ps in params:
        out.append(flat[start:start + len(ps)])
        start += len(ps)
    return out


def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None}


def completions(backend: GenerationBackend, submit, body: Mapping) -> dict[str, Any]:
    """`POST /v1/completions` (vLLM's `CompletionResponse`)."""
    model = backend.resolve_model(body.get("model"))
    sampling = parse_sampling(body, chat_request=False)
    logprobs = _int(body, "logprobs", None, minimum=0)
    if logprobs:
        raise OpenAIError(f"'logprobs'={logprobs}: only logprobs=0 (the sampled token's "
                          "log-probability) is supported; top alternatives are not.",
                          param="logprobs")
    prompts = []
    for prompt in parse_completion_prompts(body.get("prompt")):
        prompts.append(backend.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
    backend.check_stop_ids(sampling.stop_token_ids)
    budgets = [backend.check_prompt(p, sampling.max_tokens, i) for i, p in enumerate(prompts)]
    results = _run(backend, submit, model, prompts, _engine_params(backend, sampling, budgets))
    choices, finished = [], []
    for prompt, samples in zip(prompts, results, strict=True):
        for completion in samples:
            choice = finish_choice(backend, completion, sampling)
            finished.append(choice)
            entry: dict[str, Any] = {
                "index": len(choices), "text": choice.text, "logprobs": None,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids if sampling.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": list(prompt) if sampling.return_token_ids else None,
            }
            if logprobs is not None:
                entry["logprobs"] = _completion_logprobs(backend, choice, sampling)
            choices.append(entry)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(prompts, finished),
            "system_fingerprint": None}


def _completion_logprobs(backend: GenerationBackend, choice: Choice,
                         sampling: Sampling) -> dict[str, Any]:
    tokens = [backend.token_text(t, sampling.return_tokens_as_token_ids)
              for t in choice.token_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    logprobs = [max(lp, -9999.0) for lp in choice.logprobs]  # vLLM clamps -inf to -9999
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
            "top_logprobs": [{token: lp} for token, lp in zip(tokens, logprobs, strict=True)]}


def chat_completions(backend: GenerationBackend, submit, body: Mapping) -> dict[str, Any]:
    """`POST /v1/chat/completions` (vLLM's `ChatCompletionResponse`)."""
    from agentrl.models import chat

    model = backend.resolve_model(body.get("model"))
    sampling = parse_sampling(body, chat_request=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", messages, "a non-empty list of {'role', 'content'} objects")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", tools, "a list of tool schemas")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise _bad("tool_choice", tool_choice, '"auto" or "none" (required and named tool '
                   "choice are not supported)")
    if _bool(body, "add_generation_prompt", True) is False:
        raise _bad("add_generation_prompt", False, "true")
    want_logprobs = _bool(body, "logprobs", False)
    if _int(body, "top_logprobs", None, minimum=0):
        raise OpenAIError("'top_logprobs' must be 0 or absent: top alternatives are not "
                          "supported.", param="top_logprobs")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, Mapping):
        raise _bad("chat_template_kwargs", template_kwargs, "an object")
    try:
        prompt = chat.encode_messages(
            backend.tokenizer, messages, tools=tools or None, add_generation_prompt=True,
            flavour=backend.flavour,
            enable_thinking=bool(template_kwargs.get("enable_thinking", True)))
    except (ValueError, TypeError, AttributeError) as error:
        raise OpenAIError(f"messages cannot be rendered with the chat template: {error}",
                          param="messages") from error
    backend.check_stop_ids(sampling.stop_token_ids)
    budget = backend.check_prompt(prompt, sampling.max_tokens, 0)
    samples = _run(backend, submit, model, [prompt],
                   _engine_params(backend, sampling, [budget]))[0]
    parse_tools = tool_choice != "none"
    choices, finished = [], []
    for index, completion in enumerate(samples):
        choice = finish_choice(backend, completion, sampling)
        finished.append(choice)
        message, finish_reason = assistant_message(choice.text, parse_tools=parse_tools)
        entry: dict[str, Any] = {
            "index": index, "message": message, "logprobs": None,
            "finish_reason": finish_reason or choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": choice.token_ids if sampling.return_token_ids else None,
        }
        if want_logprobs:
            entry["logprobs"] = {"content": [
                _chat_logprob(backend.token_text(t, sampling.return_tokens_as_token_ids), lp)
                for t, lp in zip(choice.token_ids, choice.logprobs, strict=True)]}
        choices.append(entry)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage([prompt], finished),
            "prompt_token_ids": prompt if sampling.return_token_ids else None,
            "system_fingerprint": None}


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": max(logprob, -9999.0),
            "bytes": list(token.encode("utf-8")), "top_logprobs": []}


def assistant_message(text: str, *, parse_tools: bool = True) -> tuple[dict[str, Any], str | None]:
    """The OpenAI assistant message of a generation, and `"tool_calls"` when it called tools.

    Hermes `<tool_call>` blocks become `tool_calls` (`arguments` as a JSON
    string, as OpenAI sends them) and the content is the text around them
    (None when empty), as vLLM's hermes tool parser does; a think block goes
    to `reasoning_content` (vLLM's qwen3 reasoning parser). Without either,
    the content is the text as generated.
    """
    from agentrl.models import chat

    parsed = chat.parse_assistant(text)
    calls = parsed.tool_calls if parse_tools else []
    message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if calls or parsed.reasoning is not None:
        content = parsed.content if calls else _without_think(text)
        message["content"] = content or None
    if not calls:
        return message, None
    message["tool_calls"] = [
        {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
         "function": {"name": call["name"],
                      "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
        for call in calls]
    return message, "tool_calls"


def _without_think(text: str) -> str:
    """The text after the reasoning: after the last `</think>`, or before an unclosed `<think>`."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[-1].strip()
    return text.split("<think>", 1)[0].strip()


def collective_rpc(backend: GenerationBackend, body: Mapping) -> dict[str, Any]:
    """`POST /collective_rpc`: the two methods of vLLM's in-place weight reload."""
    method = body.get("method")
    if method is None:
        raise OpenAIError("Missing 'method' in request body", param="method")
    args = body.get("args") or []
    kwargs = body.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, Mapping):
        raise OpenAIError("'args' must be a list and 'kwargs' an object.", param="args")
    if method == "update_config":
        overrides = kwargs.get("overrides", args[0] if args else None)
        backend.update_config(overrides)
    elif method == "reload_weights":
        if args or kwargs:
            raise OpenAIError("reload_weights takes no arguments here; point the server at a "
                              "directory with update_config first.", param="args")
        backend.reload_weights()
    else:
        raise OpenAIError(f"method {method!r} is not supported by agentrl serve; supported: "
                          "update_config, reload_weights.", param="method")
    return {"results": [None]}


# ---------------------------------------------------------------------------
# HTTP.
# ---------------------------------------------------------------------------


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many clients connect at once; the default (5) drops SYNs
    allow_reuse_address = True


class OpenAIServer:
    """The HTTP front end: routes, JSON, errors; generation goes through a `RequestBatcher`.

    Several `OpenAIServer`s may share one `GenerationBackend` (tests run two
    "servers" over one engine); each has its own batcher and counters.

    Attributes:
      backend: the `GenerationBackend`.
      batcher: the `RequestBatcher`.
      url: `http://HOST:PORT` once started.
      request_counts: requests per path.
      api_key: when set, `/v1/*` requests need `Authorization: Bearer <key>`
        (what `vllm serve --api-key` guards); other paths stay open, as in vLLM.
    """

    def __init__(self, backend: GenerationBackend, *, host: str = "127.0.0.1", port: int = 8000,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS, max_batch_prompts: int | None = None,
                 api_key: str | None = None):
        self.backend = backend
        self.api_key = api_key
        self.batcher = RequestBatcher(
            backend.generate, max_wait_s=max_wait_ms / 1000,
            max_prompts=max_batch_prompts or backend.engine.max_batch_size)
        self.request_counts: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), _make_handler(self))
        self.host, self.port = self._httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "OpenAIServer":
        """Serves in a background thread; returns self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="agentrl-serve",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def shutdown(self) -> None:
        """Stops accepting requests, then stops the batcher."""
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.batcher.stop()

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _count(self, path: str) -> None:
        with self._count_lock:
            self.request_counts[path] = self.request_counts.get(path, 0) + 1

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """`(status, payload)` of one request; payload is a dict (JSON), str (text) or None."""
        self._count(path)
        backend = self.backend
        if method == "GET":
            if path == "/health":
                return 200, None
            if path == "/v1/models":
                return 200, {"object": "list", "data": backend.model_cards()}
            if path == "/version":
                return 200, {"version": f"agentrl (vLLM {VLLM_PROTOCOL_VERSION} protocol)"}
            raise OpenAIError(f"GET {path} not found.", status=404)
        routes = {
            "/v1/completions": lambda: completions(backend, self.batcher.submit, body),
            "/v1/chat/completions": lambda: chat_completions(backend, self.batcher.submit, body),
            "/v1/load_lora_adapter": lambda: backend.load_lora(
                body.get("lora_name"), body.get("lora_path"), bool(body.get("load_inplace"))),
            "/v1/unload_lora_adapter": lambda: backend.unload_lora(body.get("lora_name")),
            "/collective_rpc": lambda: collective_rpc(backend, body),
            "/reset_prefix_cache": lambda: None,
        }
        if path not in routes:
            raise OpenAIError(f"POST {path} not found.", status=404)
        if path != "/reset_prefix_cache" and not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object.", param=None)
        return 200, routes[path]()


def _make_handler(server: OpenAIServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "agentrl-serve"

        def log_message(self, format, *args):
            logger.debug("%s %s", self.address_string(), format % args)

        def do_GET(self):
            self._dispatch("GET", None)

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body: Any = None
            if raw:
                try:
                    body = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as error:
                    self._reply(400, OpenAIError(f"JSON decode error: {error}").body())
                    return
            self._dispatch("POST", body)

        def _dispatch(self, method: str, body: Any) -> None:
            path = self.path.split("?", 1)[0]
            if server.api_key is not None and path.startswith("/v1") and not hmac.compare_digest(
                    self.headers.get("Authorization", ""), f"Bearer {server.api_key}"):
                self._reply(401, {"error": "Unauthorized"})  # vLLM's answer, verbatim
                return
            try:
                status, payload = server.handle(method, path, body)
            except OpenAIError as error:
                status, payload = error.status, error.body()
            except Exception as error:
                logger.exception("%s %s failed", method, path)
                status = 500
                payload = OpenAIError(f"{type(error).__name__}: {error}", status=500).body()
            self._reply(status, payload)

        def _reply(self, status: int, payload: Any) -> None:
            if payload is None:
                data, kind = b"", "application/json"
            elif isinstance(payload, str):
                data, kind = payload.encode("utf-8"), "text/plain; charset=utf-8"
            else:
                data, kind = json.dumps(payload, ensure_ascii=False).encode("utf-8"), \
                    "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


# ---------------------------------------------------------------------------
# Building a server from a checkpoint or a preset; the CLI.
# ---------------------------------------------------------------------------


def build_backend(model: str, *, dtype: str = "float32", max_batch_size: int = 64,
                  max_model_len: int | None = None, served_model_name: str | None = None,
                  tokenizer: str | None = None, seed: int = 0) -> GenerationBackend:
    """A `GenerationBackend` over an HF checkpoint directory or a preset (random weights).

    Args:
      model: an HF checkpoint directory (`load_pretrained`) or a preset name
        of `agentrl.models.PRESETS` (`"tiny"`, ...: random parameters).
      dtype: parameter and compute dtype.
      max_batch_size: rows per jitted engine call (`JaxEngine`).
      max_model_len: most prompt + completion tokens (default: the model's
        `max_position_embeddings`).
      served_model_name: the `model` name clients send (default: `model`).
      tokenizer: a bundled name or a directory (default: the checkpoint's
        tokenizer.json, else the bundled Qwen tokenizer of its family).
      seed: parameter seed of a preset, and the engine's sampling stream.
    """
    from agentrl.models import PRESETS, Policy, get_tokenizer, load_pretrained, model_config
    from agentrl.rollout.jax_engine import JaxEngine

    path = pathlib.Path(model)
    if path.is_dir():
        policy = load_pretrained(path, dtype=dtype)
        model_path: str | None = str(path.resolve())
        default_tokenizer = str(path) if (path / "tokenizer.json").is_file() else None
    elif model in PRESETS:
        policy = Policy.init(model_config(model, dtype=dtype, param_dtype=dtype), seed)
        model_path, default_tokenizer = None, None
    else:
        raise ValueError(
            f"--model {model!r} is neither a checkpoint directory nor a preset; pass an HF "
            f"checkpoint directory or one of {sorted(PRESETS)}.")
    if default_tokenizer is None:
        default_tokenizer = "qwen3" if policy.config.model_type == "qwen3" else "qwen2.5"
    engine = JaxEngine(policy, max_batch_size=max_batch_size, max_total_length=max_model_len,
                       seed=seed, show_progress=False)
    return GenerationBackend(engine, get_tokenizer(tokenizer or default_tokenizer),
                             served_model_name or model, model_path=model_path)


def add_serve_arguments(parser) -> None:
    """The flags of `agentrl serve` (vLLM's names where vLLM has the flag)."""
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory, or a preset name for random weights "
                             "(e.g. tiny)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-batch-size", type=int, default=64,
                        help="rows per engine call; concurrent requests are batched up to it")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most prompt + completion tokens (default: the model's)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: --model)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer: bundled name (qwen2.5, qwen3) or directory")
    parser.add_argument("--batch-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                        help="how long the first waiting request waits for others to join "
                             "its batch")
    parser.add_argument("--seed", type=int, default=0,
                        help="preset parameter seed and sampling stream of unseeded requests")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 requests (as vLLM)")


def serve_main(args) -> int:
    """Runs `agentrl serve` until SIGINT / SIGTERM; prints the URL once listening."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("max_batch_size", "port"):
        if getattr(args, name) < (1 if name == "max_batch_size" else 0):
            print(f"agentrl serve: --{name.replace('_', '-')}={getattr(args, name)} is out of "
                  "range", file=sys.stderr)
            return 2
    try:
        backend = build_backend(args.model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                                max_model_len=args.max_model_len,
                                served_model_name=args.served_model_name,
                                tokenizer=args.tokenizer, seed=args.seed)
        server = OpenAIServer(backend, host=args.host, port=args.port,
                              max_wait_ms=args.batch_wait_ms, api_key=args.api_key)
    except (FileNotFoundError, KeyError, ValueError, NotImplementedError, OSError) as error:
        print(f"agentrl serve: {error}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"agentrl serve: listening on {server.url} (model {backend.served_model_name!r}, "
          f"max_model_len {backend.max_model_len})", flush=True)
    while not stop.wait(0.5):
        pass
    print("agentrl serve: shutting down", flush=True)
    server.shutdown()
    return 0


__all__ = [
    "GenerationBackend",
    "OpenAIError",
    "OpenAIServer",
    "RequestBatcher",
    "add_serve_arguments",
    "assistant_message",
    "build_backend",
    "chat_completions",
    "collective_rpc",
    "completions",
    "finish_choice",
    "serve_main",
]
