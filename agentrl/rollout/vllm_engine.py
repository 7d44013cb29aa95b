"""`VLLMEngine`: the `Engine` protocol over one or more vLLM OpenAI-compatible servers.

    engine = VLLMEngine(["http://gpu-node-1:8000", "http://gpu-node-2:8000"], "policy")
    engine.wait_until_ready()
    completions = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=512,
                                                             stop_token_ids=tok.stop_token_ids),
                                  sticky_keys=trajectory_ids)        # optional
    engine.sync_weights(policy, "/shared/export/step_100")           # full weights
    engine.sync_lora(params, spec, config, "/shared/lora/step_100", "policy-step-100")

Protocol (vLLM 0.11; `docs/rollouts.md`): one
`POST /v1/completions` per prompt with the prompt as token ids, `n=1`,
`logprobs=0`, `return_token_ids=true` and `return_tokens_as_token_ids=true`;
the completion's ids are read from `choices[0].token_ids` (or, from servers
older than vLLM 0.10.2, from the `"token_id:123"` strings of
`logprobs.tokens`) and never re-tokenised from text (SPEC §1). Requests set
`ignore_eos=true` so that generation stops exactly on `stop_token_ids`, as
`JaxEngine` does, and send the neutral penalties (`repetition_penalty=1`, ...)
so a checkpoint's `generation_config.json` defaults cannot change the
sampling distribution. The returned log-probabilities are the sampling
distribution's only when the server runs with `--logprobs-mode
processed_logprobs`; greedy requests (temperature 0) get 0, as the `Engine`
protocol defines.

`generate` is a blocking, batched call: the requests run concurrently on an
asyncio event loop in a background thread (httpx, connection pooling), at
most `max_concurrency_per_server` at a time per server. Routing:

* least outstanding requests (ties: fewest requests so far), skipping
  servers that failed within their cool-down;
* stickiness: requests with the same `sticky_keys` entry go to the same
  server (prefix-cache hits for the turns of one trajectory), unless it fails;
* retries: connection errors, timeouts, HTTP 408/425/429/5xx are retried up
  to `max_retries` times with exponential backoff, each retry on another
  server when there is one (failover); other HTTP errors fail at once;
* when a request gives up, `VLLMEngineError` names its index, the servers
  tried and what each answered (never the API key).

Weight sync (vLLM keeps no trainer state, so weights travel through shared
storage): `sync_weights` writes an HF checkpoint (`Policy.save_pretrained`)
and asks every server to reload it (`POST /collective_rpc` `update_config`
then `reload_weights`, then `POST /reset_prefix_cache`; vLLM needs
`VLLM_SERVER_DEV_MODE=1`); `sync_lora` writes a PEFT adapter
(`save_peft_adapter`) and loads it on every server (`POST
/v1/load_lora_adapter`; vLLM needs `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); later requests use the adapter's
name as `model`.
"""

import asyncio
import collections
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

from agentrl.rollout.engine import Completion, SamplingParams, per_prompt_params

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json")
_EXCERPT_CHARS = 300
_PROBE_S = 10.0  # limit of one readiness probe (GET /health, /v1/models)
_INT64 = 2**63


class VLLMEngineError(RuntimeError):
    """A request to the vLLM servers failed for good.

    Attributes:
      servers: the server URLs involved (tried, or asked to sync).
      index: the prompt's index in the `generate` call (None for other calls).
      status: the last HTTP status (None for a connection error or timeout).
    """

    def __init__(self, message: str, *, servers: Sequence[str] = (), index: int | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.servers = tuple(servers)
        self.index = index
        self.status = status


@dataclasses.dataclass(eq=False)
class ServerState:
    """Routing state and counters of one server (touched only on the engine's event loop).

    Attributes:
      url: the server root (`http://host:port`, without `/v1`).
      outstanding: requests routed to it and not finished.
      requests: requests sent to it (retries included).
      completed: requests it answered successfully.
      failures: requests that failed on it (connection, timeout, HTTP 5xx, ...).
      down_until: `time.monotonic()` before which it is avoided after a failure.
    """

    url: str
    outstanding: int = 0
    requests: int = 0
    completed: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    semaphore: asyncio.Semaphore | None = None


def _root_url(url: Any) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"VLLMEngine: base_urls entry {url!r} must be an http(s) URL such as "
                         "'http://gpu-node-1:8000' (with or without /v1).")
    root = url.rstrip("/")
    return root.removesuffix("/v1")


def _signed_seed(seed: int) -> int:
    """`seed mod 2**64` as the int64 vLLM accepts (same 64 bits, so the same stream)."""
    return (seed + _INT64) % 2**64 - _INT64


class VLLMEngine:
    """Client of vLLM OpenAI-compatible servers implementing the `Engine` protocol.

    Args:
      base_urls: server roots (`http://host:8000`, with or without `/v1`).
      model: the `model` field of requests: the served model name
        (`vllm serve ... --served-model-name`), later a LoRA adapter's name
        (`sync_lora`).
      timeout_s: limit of one request (connect, generate, read), seconds.
      connect_timeout_s: limit of establishing a connection.
      max_retries: retries after the first attempt of a request.
      backoff_s: delay before the first retry; doubled per retry, capped at
        `backoff_max_s`. A failed server is also avoided for that long.
      backoff_max_s: the cap.
      max_concurrency_per_server: requests in flight per server (vLLM
        batches them; its `--max-num-seqs` bounds what runs at once).
      api_key_env: name of the environment variable holding the key of
        `vllm serve --api-key` (None: no Authorization header). Read once here;
        never logged or put in an error.
      max_model_len: the servers' context length; when known (here, or read
        from `/v1/models` by `wait_until_ready`) each request's `max_tokens`
        is cut to the room left after its prompt, as `JaxEngine` does.
      sticky_capacity: most remembered `sticky_keys` (least recently used
        ones are forgotten).
      trust_env: let httpx read proxy settings from the environment (off:
        rollout traffic stays inside the cluster).

    Attributes:
      policy_version: incremented by every `sync_weights` / `sync_lora`.
      retries: retries made so far.
    """

    def __init__(self, base_urls: Sequence[str], model: str, *, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, max_retries: int = 3, backoff_s: float = 0.5,
                 backoff_max_s: float = 30.0, max_concurrency_per_server: int = 64,
                 api_key_env: str | None = None, max_model_len: int | None = None,
                 sticky_capacity: int = 100_000, trust_env: bool = False):
        if isinstance(base_urls, str):
            base_urls = [base_urls]
        roots = [_root_url(url) for url in base_urls]
        if not roots:
            raise ValueError("VLLMEngine: base_urls is empty; pass at least one server URL.")
        if len(set(roots)) != len(roots):
            raise ValueError(f"VLLMEngine: base_urls {roots} lists a server twice.")
        if not isinstance(model, str) or not model:
            raise ValueError(f"VLLMEngine: model={model!r} must be the served model name.")
        if not (timeout_s > 0 and connect_timeout_s > 0):
            raise ValueError(f"VLLMEngine: timeout_s={timeout_s} and connect_timeout_s="
                             f"{connect_timeout_s} must be > 0.")
        if max_retries < 0 or backoff_s < 0 or backoff_max_s < 0:
            raise ValueError(f"VLLMEngine: max_retries={max_retries}, backoff_s={backoff_s}, "
                             f"backoff_max_s={backoff_max_s} must be >= 0.")
        if max_concurrency_per_server < 1:
            raise ValueError(f"VLLMEngine: max_concurrency_per_server="
                             f"{max_concurrency_per_server} must be >= 1.")
        self.model = model
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_concurrency_per_server = int(max_concurrency_per_server)
        self.api_key_env = api_key_env
        self.max_model_len = max_model_len
        self.sticky_capacity = int(sticky_capacity)
        self.trust_env = trust_env
        self.policy_version = 0
        self.retries = 0
        self.servers = [ServerState(root) for root in roots]
        self._api_key = self._read_key(api_key_env)
        self._sticky: collections.OrderedDict[Hashable, ServerState] = collections.OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client = None
        self._start_lock = threading.Lock()
        self._lora_names: set[str] = set()

    @staticmethod
    def _read_key(api_key_env: str | None) -> str | None:
        if api_key_env is None:
            return None
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"VLLMEngine: the environment variable {api_key_env!r} "
                             "(api_key_env) is not set or empty; export it, or pass "
                             "api_key_env=None for servers without --api-key.")
        return key

    def __repr__(self) -> str:
        return (f"VLLMEngine(servers={[s.url for s in self.servers]}, model={self.model!r}, "
                f"api_key_env={self.api_key_env!r}, timeout_s={self.timeout_s:g}, "
                f"max_retries={self.max_retries})")

    # -- the event loop --------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                try:
                    import httpx
                except ImportError as error:
                    raise ImportError("VLLMEngine needs httpx: pip install 'httpx>=0.27,<1'"
                                      ) from error
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="agentrl-vllm-engine",
                                          daemon=True)
                thread.start()
                headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
                connections = self.max_concurrency_per_server * len(self.servers)

                async def make_client():
                    for server in self.servers:
                        server.semaphore = asyncio.Semaphore(self.max_concurrency_per_server)
                    return httpx.AsyncClient(
                        timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                        limits=httpx.Limits(max_connections=connections,
                                            max_keepalive_connections=connections),
                        headers=headers, trust_env=self.trust_env)

                self._client = asyncio.run_coroutine_threadsafe(make_client(), loop).result()
                self._loop, self._thread = loop, thread
            return self._loop

    def _run(self, coroutine) -> Any:
        loop = self._ensure_loop()
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("VLLMEngine: a blocking call from the engine's own event loop "
                               "would deadlock; await engine.agenerate(...) instead.")
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Closes the connections and stops the background loop (idempotent)."""
        with self._start_lock:
            loop, thread, client = self._loop, self._thread, self._client
            self._loop = self._thread = self._client = None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation ------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        sticky_keys: Sequence[Hashable] | None = None,
    ) -> list[Completion]:
        """One `Completion` per prompt, in order (the `Engine` protocol).

        Args:
          prompts: token-id prompts.
          params: one `SamplingParams` for all, or one per prompt.
          sticky_keys: optional, one hashable per prompt (e.g. a trajectory
            id): prompts with the same key go to the same server while it
            works, so its prefix cache serves the trajectory's earlier turns.

        Raises:
          ValueError: an empty prompt, one that leaves no room to generate,
            or mismatched lengths.
          VLLMEngineError: a request failed for good (its index and servers
            named).
        """
        requests, prompts, sticky_keys = self._prepare(prompts, params, sticky_keys)
        if not prompts:
            return []
        return self._run(self._generate(prompts, requests, sticky_keys))

    async def agenerate(self, prompts, params, *, sticky_keys=None) -> list[Completion]:
        """`generate` for callers that are themselves coroutines (any event loop)."""
        requests, prompts, sticky_keys = self._prepare(prompts, params, sticky_keys)
        if not prompts:
            return []
        loop = self._ensure_loop()
        future = asyncio.run_coroutine_threadsafe(
            self._generate(prompts, requests, sticky_keys), loop)
        return await asyncio.wrap_future(future)

    def _prepare(self, prompts, params, sticky_keys):
        requests = per_prompt_params(prompts, params)
        checked = []
        for index, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"generate: prompt {index} is empty; pass at least one token id.")
            if self.max_model_len is not None and len(ids) >= self.max_model_len:
                raise ValueError(
                    f"generate: prompt {index} has {len(ids)} tokens, but the servers' "
                    f"max_model_len={self.max_model_len} leaves no room to generate; truncate "
                    "the prompt or serve with a larger --max-model-len.")
            checked.append(ids)
        if sticky_keys is not None:
            sticky_keys = list(sticky_keys)
            if len(sticky_keys) != len(checked):
                raise ValueError(f"generate: {len(checked)} prompts but {len(sticky_keys)} "
                                 "sticky_keys; pass one key per prompt (or none).")
        return requests, checked, sticky_keys

    async def _generate(self, prompts, requests, sticky_keys) -> list[Completion]:
        tasks = [asyncio.ensure_future(self._complete(
            index, prompt, request, None if sticky_keys is None else sticky_keys[index]))
            for index, (prompt, request) in enumerate(zip(prompts, requests, strict=True))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            raise
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            pending = [t for t in tasks if not t.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise min((t.exception() for t in failed),
                      key=lambda e: getattr(e, "index", None) or 0)
        return [task.result() for task in tasks]

    def _body(self, prompt: list[int], request: SamplingParams) -> dict[str, Any]:
        max_tokens = request.max_new_tokens
        if self.max_model_len is not None:
            max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "n": 1,
            "temperature": request.temperature, "top_p": request.top_p,
            "top_k": request.top_k if request.top_k > 0 else -1,
            "stop_token_ids": list(request.stop_token_ids), "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False, "stream": False,
            # Neutral values, sent so a checkpoint's generation_config.json cannot change them.
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "min_p": 0.0,
        }
        if request.seed is not None:
            body["seed"] = _signed_seed(request.seed)
        return body

    async def _complete(self, index: int, prompt: list[int], request: SamplingParams,
                        key: Hashable | None) -> Completion:
        body = self._body(prompt, request)
        tried: list[ServerState] = []
        problems: list[str] = []
        status = None
        for attempt in range(1, self.max_retries + 2):
            server = self._route(key, tried)
            server.outstanding += 1
            server.requests += 1
            try:
                async with server.semaphore:
                    status, payload, problem = await self._post(server, "/v1/completions", body)
            finally:
                server.outstanding -= 1
            if problem is None:
                completion = self._parse(index, server, payload, request)
                server.completed += 1
                server.consecutive_failures = 0
                return completion
            if status is not None and status not in RETRY_STATUSES:
                raise VLLMEngineError(
                    f"generate: request {index} ({len(prompt)} prompt tokens) was rejected by "
                    f"{server.url}: {problem}", servers=[server.url], index=index, status=status)
            self._mark_failed(server)
            tried.append(server)
            problems.append(f"{server.url}: {problem}")
            if attempt <= self.max_retries:
                self.retries += 1
                delay = self._delay(attempt)
                logger.warning("generate: request %d on %s: %s; retry %d/%d in %.2f s", index,
                               server.url, problem, attempt, self.max_retries, delay)
                await asyncio.sleep(delay)
        servers = list(dict.fromkeys(s.url for s in tried))
        raise VLLMEngineError(
            f"generate: request {index} ({len(prompt)} prompt tokens) failed after "
            f"{len(problems)} attempt(s) on {', '.join(servers)}: {'; '.join(problems[-4:])}",
            servers=servers, index=index, status=status)

    def _route(self, key: Hashable | None, avoid: Sequence[ServerState]) -> ServerState:
        """Least outstanding requests among working servers; a sticky key's server first."""
        now = time.monotonic()
        candidates = [s for s in self.servers if s not in avoid] or list(self.servers)
        working = [s for s in candidates if s.down_until <= now] or candidates
        if key is not None:
            bound = self._sticky.get(key)
            if bound is not None and bound in working:
                self._sticky.move_to_end(key)
                return bound
        order = {id(s): i for i, s in enumerate(self.servers)}
        chosen = min(working, key=lambda s: (s.outstanding, s.requests, order[id(s)]))
        if key is not None:
            self._sticky[key] = chosen
            self._sticky.move_to_end(key)
            while len(self._sticky) > self.sticky_capacity:
                self._sticky.popitem(last=False)
        return chosen

    def _delay(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s)

    def _mark_failed(self, server: ServerState) -> None:
        server.failures += 1
        server.consecutive_failures += 1
        server.down_until = time.monotonic() + self._delay(server.consecutive_failures)

    def _parse(self, index: int, server: ServerState, payload: Any,
               request: SamplingParams) -> Completion:
        def fail(why: str) -> VLLMEngineError:
            excerpt = self._scrub(json.dumps(payload)[:_EXCERPT_CHARS])
            return VLLMEngineError(f"generate: request {index}: {server.url} {why}: {excerpt}",
                                   servers=[server.url], index=index)

        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise fail("returned no choices (not an OpenAI completion)")
        choice = choices[0]
        logprobs = choice.get("logprobs") or {}
        tokens, token_logprobs = logprobs.get("tokens"), logprobs.get("token_logprobs")
        id_tokens = None
        if isinstance(tokens, list) and all(
                isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            id_tokens = [int(t.removeprefix("token_id:")) for t in tokens]
        token_ids = choice.get("token_ids")
        if token_ids is None:
            token_ids = id_tokens
        elif id_tokens is not None and id_tokens != list(token_ids):
            raise fail("returned token_ids that disagree with logprobs.tokens")
        if token_ids is None:
            raise fail("returned no token ids (VLLMEngine needs vLLM >= 0.10.2 for "
                       "return_token_ids, or return_tokens_as_token_ids with logprobs)")
        if not isinstance(token_logprobs, list) or len(token_logprobs) != len(token_ids):
            raise fail("returned no log-probability per sampled token (logprobs=0 was asked)")
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise fail(f"finished with finish_reason={finish!r} (expected 'stop' or 'length')")
        try:
            values = [float(v) for v in token_logprobs]
            ids = [int(t) for t in token_ids]
        except (TypeError, ValueError) as error:
            raise fail(f"returned malformed ids or logprobs ({error})") from None
        if request.temperature == 0:
            values = [0.0] * len(ids)  # the Engine protocol: greedy log-probabilities are 0
        return Completion(token_ids=ids, logprobs=values, finish_reason=finish)

    # -- HTTP ------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    async def _post(self, server: ServerState, path: str, body: Any, method: str = "POST",
                    timeout_s: float | None = None) -> tuple[int | None, Any, str | None]:
        """`(status, payload, problem)`; problem is None on a 2xx answer."""
        import httpx

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            response = await asyncio.wait_for(
                self._client.request(method, server.url + path,
                                     json=body if method == "POST" else None),
                timeout=timeout_s)
        except (TimeoutError, httpx.TimeoutException):
            return None, None, f"timed out after {timeout_s:g} s"
        except httpx.HTTPError as error:
            reason = self._scrub(str(error))
            return None, None, f"connection error: {type(error).__name__}: {reason}"
        text = response.text
        if response.status_code >= 400:
            return response.status_code, None, f"HTTP {response.status_code}: " + \
                self._scrub(_error_message(text)[:_EXCERPT_CHARS])
        if not text:
            return response.status_code, None, None
        try:
            return response.status_code, json.loads(text), None
        except json.JSONDecodeError:
            return response.status_code, text, None

    async def _admin(self, server: ServerState, path: str, body: Any = None,
                     method: str = "POST") -> tuple[int | None, Any, str | None]:
        """A control request, retried like generation requests on connection errors and 5xx."""
        status, payload, problem = None, None, None
        for attempt in range(1, self.max_retries + 2):
            status, payload, problem = await self._post(server, path, body, method)
            if problem is None or (status is not None and status not in RETRY_STATUSES):
                break
            if attempt <= self.max_retries:
                self.retries += 1
                await asyncio.sleep(self._delay(attempt))
        return status, payload, problem

    async def _on_all(self, step, what: str) -> list[Any]:
        results = await asyncio.gather(*(step(s) for s in self.servers), return_exceptions=True)
        failed = [(s, r) for s, r in zip(self.servers, results, strict=True)
                  if isinstance(r, BaseException)]
        if failed:
            raise VLLMEngineError(
                f"{what} failed on {len(failed)} of {len(self.servers)} server(s): "
                + "; ".join(f"{s.url}: {r}" for s, r in failed),
                servers=[s.url for s, _ in failed])
        return results

    # -- readiness -------------------------------------------------------------

    def health(self) -> dict[str, bool]:
        """`{url: GET /health answered 200}` for every server (no retries)."""
        async def check(server):
            status, _, problem = await self._post(server, "/health", None, "GET", _PROBE_S)
            return problem is None and status == 200

        async def check_all():
            return await asyncio.gather(*(check(s) for s in self.servers))

        results = self._run(check_all())
        return {s.url: ok for s, ok in zip(self.servers, results, strict=True)}

    def wait_until_ready(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> dict[str, int]:
        """Waits until every server answers `/health` and lists `model` in `/v1/models`.

        Records the smallest `max_model_len` the servers report (unless one
        was given), so prompts are checked and `max_tokens` cut as
        `JaxEngine` does.

        Returns:
          `{url: max_model_len}` (0 where the server does not report it).

        Raises:
          VLLMEngineError: some server was not ready in time (named, with why).
        """
        return self._run(self._wait_until_ready(timeout_s, poll_s))

    async def _wait_until_ready(self, timeout_s: float, poll_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        ready: dict[str, int] = {}
        problems: dict[str, str] = {}
        while True:
            for server in self.servers:
                if server.url in ready:
                    continue
                _, _, problem = await self._post(server, "/health", None, "GET", _PROBE_S)
                if problem is not None:
                    problems[server.url] = problem
                    continue
                _, payload, problem = await self._post(server, "/v1/models", None, "GET",
                                                       _PROBE_S)
                cards = payload.get("data") if isinstance(payload, dict) else None
                if problem is not None or not isinstance(cards, list):
                    problems[server.url] = problem or "GET /v1/models returned no model list"
                    continue
                card = next((c for c in cards if isinstance(c, dict) and c.get("id") == self.model),
                            None)
                if card is None:
                    served = [c.get("id") for c in cards if isinstance(c, dict)]
                    problems[server.url] = f"serves {served}, not {self.model!r}"
                    continue
                ready[server.url] = int(card.get("max_model_len") or 0)
                problems.pop(server.url, None)
            if len(ready) == len(self.servers):
                known = [n for n in ready.values() if n > 0]
                if known and self.max_model_len is None:
                    self.max_model_len = min(known)
                return ready
            if time.monotonic() >= deadline:
                raise VLLMEngineError(
                    f"wait_until_ready: {len(self.servers) - len(ready)} server(s) not ready "
                    f"after {timeout_s:g} s: "
                    + "; ".join(f"{url}: {why}" for url, why in problems.items()),
                    servers=list(problems))
            await asyncio.sleep(poll_s)

    # -- weight sync -----------------------------------------------------------

    def sync_weights(self, policy_or_params, export_dir: str | os.PathLike, *, config=None,
                     dtype: str | None = None, tokenizer_dir: str | os.PathLike | None = None,
                     max_shard_bytes: int = 5 * 1024**3) -> pathlib.Path:
        """Exports full weights to shared storage and has every server reload them.

        Steps: `Policy.save_pretrained(export_dir)` (LoRA adapters merged), then
        on every server `POST /collective_rpc` `update_config` (the model path
        becomes `export_dir`), `reload_weights`, and `POST /reset_prefix_cache`
        (cached KV of the old weights must not be reused).

        Args:
          policy_or_params: a `Policy`, or a parameter tree with `config`.
          export_dir: a directory every server can read (shared storage).
          config: the `QwenConfig` when passing bare parameters.
          dtype: stored dtype (e.g. `"bfloat16"` for `vllm serve --dtype bfloat16`).
          tokenizer_dir: copy its tokenizer / generation-config files along, so
            the export is a complete checkpoint.
          max_shard_bytes: largest safetensors file.

        Returns:
          The export directory.

        Raises:
          VLLMEngineError: a server failed to reload (named; a 404 means vLLM
            runs without `VLLM_SERVER_DEV_MODE=1`).
        """
        from agentrl.models.policy import Policy

        if isinstance(policy_or_params, Policy):
            policy = policy_or_params
        elif config is None:
            raise ValueError("sync_weights: pass a Policy, or the parameters with config=.")
        else:
            policy = Policy(config, policy_or_params)
        path = pathlib.Path(policy.save_pretrained(export_dir, dtype=dtype,
                                                   max_shard_bytes=max_shard_bytes)).resolve()
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                source = pathlib.Path(tokenizer_dir) / name
                if source.is_file():
                    shutil.copyfile(source, path / name)
        overrides = {"model_config": {"model": str(path)}, "load_config": {"load_format": "auto"}}
        hint = " (vLLM serves /collective_rpc only with VLLM_SERVER_DEV_MODE=1)"

        async def reload(server):
            steps = [("/collective_rpc", {"method": "update_config",
                                          "kwargs": {"overrides": overrides}}),
                     ("/collective_rpc", {"method": "reload_weights"}),
                     ("/reset_prefix_cache", None)]
            for route, body in steps:
                status, _, problem = await self._admin(server, route, body)
                if problem is not None:
                    what = body["method"] if body else route
                    raise VLLMEngineError(f"{what}: {problem}" + (hint if status == 404 else ""))

        self._run(self._on_all(reload, f"sync_weights({path})"))
        self.policy_version += 1
        logger.info("sync_weights: %d server(s) reloaded %s", len(self.servers), path)
        return path

    def sync_lora(self, params, spec, config, export_dir: str | os.PathLike, name: str, *,
                  base_model_name_or_path: str | None = None, dtype: str | None = None,
                  unload_previous: bool = True) -> pathlib.Path:
        """Exports a PEFT adapter and loads it on every server as model `name`.

        Steps: `save_peft_adapter(export_dir, ...)`, then on every server
        `POST /v1/load_lora_adapter` (when `name` is already loaded: `POST
        /v1/unload_lora_adapter` first; vLLM's `load_inplace` is not used, see
        below), `POST /reset_prefix_cache` (best effort: it is a 404 without
        `VLLM_SERVER_DEV_MODE=1`), and `POST /v1/unload_lora_adapter` of the
        adapter the previous `sync_lora` loaded. Later `generate` calls send
        `model=name`.

        Use a fresh `name` per sync (`f"policy-step-{step}"`): vLLM keys its
        prefix cache on the adapter's name, so reusing a name can serve KV
        computed by the old adapter unless the prefix cache is reset. (vLLM's
        `load_inplace=true` also keeps re-reading the adapter from disk on every
        step in the versions that have it; unload + load avoids that.)

        Args:
          params: parameters holding the `lora_*` leaves.
          spec: the `LoraSpec` (rank, alpha, targets).
          config: the base model's `QwenConfig`.
          export_dir: a directory every server can read.
          name: the adapter's model name (e.g. `f"policy-step-{step}"`).
          base_model_name_or_path: recorded in adapter_config.json.
          dtype: stored dtype of the adapter.
          unload_previous: unload the adapter of the previous `sync_lora`.

        Returns:
          The adapter directory.
        """
        from agentrl.models.lora import save_peft_adapter

        if not isinstance(name, str) or not name:
            raise ValueError(f"sync_lora: name={name!r} must be a non-empty adapter name.")
        path = pathlib.Path(save_peft_adapter(
            export_dir, params, spec, config, base_model_name_or_path=base_model_name_or_path,
            dtype=dtype)).resolve()
        previous = self.model if self.model in self._lora_names and self.model != name else None
        reload = name in self._lora_names
        body = {"lora_name": name, "lora_path": str(path)}
        hint = (" (vLLM needs --enable-lora, --max-lora-rank >= the adapter's rank and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")

        async def load(server):
            if reload:
                await self._admin(server, "/v1/unload_lora_adapter", {"lora_name": name})
            status, _, problem = await self._admin(server, "/v1/load_lora_adapter", body)
            if problem is not None and status == 400 and "already been loaded" in problem:
                await self._admin(server, "/v1/unload_lora_adapter", {"lora_name": name})
                status, _, problem = await self._admin(server, "/v1/load_lora_adapter", body)
            if problem is not None:
                raise VLLMEngineError(f"load_lora_adapter: {problem}"
                                      + (hint if status in (404, 400) else ""))
            status, _, problem = await self._admin(server, "/reset_prefix_cache")
            if problem is not None:
                logger.warning("sync_lora: %s could not reset its prefix cache (%s); use a new "
                               "adapter name per sync or VLLM_SERVER_DEV_MODE=1", server.url,
                               problem)
            if previous is not None and unload_previous:
                status, _, problem = await self._admin(server, "/v1/unload_lora_adapter",
                                                       {"lora_name": previous})
                if problem is not None:
                    logger.warning("sync_lora: %s could not unload %r: %s", server.url,
                                   previous, problem)

        self._run(self._on_all(load, f"sync_lora({name!r}, {path})"))
        self._lora_names.add(name)
        if previous is not None and unload_previous:
            self._lora_names.discard(previous)
        self.model = name
        self.policy_version += 1
        logger.info("sync_lora: %d server(s) serve adapter %r from %s", len(self.servers), name,
                    path)
        return path

    def sticky_server(self, key: Hashable) -> str | None:
        """The URL of the server `key` is bound to (None if unbound or forgotten)."""
        server = self._sticky.get(key)
        return None if server is None else server.url

    def server_stats(self) -> list[dict[str, Any]]:
        """Per server: url, requests, completed, failures, outstanding."""
        return [{"url": s.url, "requests": s.requests, "completed": s.completed,
                 "failures": s.failures, "outstanding": s.outstanding} for s in self.servers]


def _error_message(text: str) -> str:
    """The `message` of vLLM / OpenAI error JSON (nested or flat), else the text itself."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip() or "no body"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(data.get("message"), str):
            return data["message"]
        if isinstance(error, str):
            return error
    return text.strip()


__all__ = ["ServerState", "VLLMEngine", "VLLMEngineError"]
