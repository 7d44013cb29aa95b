"""A small client for OpenAI-compatible chat servers (the judges' and simulator's LLM).

`ChatClient` posts to `{base_url}/chat/completions` (the OpenAI REST format:
vLLM, SGLang, `agentrl serve`, OpenAI and other hosted APIs) with the standard
library's `urllib`, so it needs no extra dependency. It retries connection
errors, timeouts, HTTP 429 and 5xx with exponential backoff, and raises
`ChatClientError` naming the server URL and the request (model, message
count, n) when it gives up.

The API key is read from the environment variable named by `api_key_env`
(e.g. `"OPENAI_API_KEY"`) and sent as `Authorization: Bearer ...`; it never
appears in a repr, a log line or an exception message (server error bodies
are scrubbed of it too).

`parse_json_reply` reads the JSON object an LLM was asked to return, leniently
(reasoning blocks, code fences and surrounding prose are skipped); the judges
and the tool simulator share it.
"""

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from agentrl.rewards.parsing import parse_json

__all__ = [
    "ChatClient",
    "ChatClientError",
    "ChatClientStats",
    "ChatModel",
    "parse_json_reply",
]

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_BODY_EXCERPT_CHARS = 300


class ChatModel(Protocol):
    """What judges and the simulator need from an LLM: `ChatClient` or any adapter."""

    def chat(self, messages: Sequence[Mapping[str, Any]], *, temperature: float = ...,
             max_tokens: int = ..., n: int = ..., stop: Sequence[str] | None = ...) -> list[str]:
        ...


class ChatClientError(RuntimeError):
    """A chat request failed for good (after retries, or a non-retryable answer).

    Attributes:
      url: the endpoint.
      status: the last HTTP status, or None for a connection error / timeout.
      attempts: requests made.
    """

    def __init__(self, message: str, *, url: str, status: int | None, attempts: int):
        super().__init__(message)
        self.url = url
        self.status = status
        self.attempts = attempts


@dataclasses.dataclass
class ChatClientStats:
    """Counters of a client's traffic (thread-safe updates through the client)."""

    requests: int = 0
    retries: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self, prefix: str = "chat/") -> dict[str, int]:
        return {prefix + key: value for key, value in dataclasses.asdict(self).items()}


def _endpoint(base_url: str) -> str:
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(
            f"base_url={base_url!r} must be an http(s) URL such as 'http://localhost:8000/v1'"
        )
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


class ChatClient:
    """Blocking client of an OpenAI-compatible `/v1/chat/completions` endpoint.

    Args:
      base_url: server root, with or without `/v1` (`http://localhost:8000`,
        `http://localhost:8000/v1` and `https://api.openai.com/v1` all work).
      model: the `model` field of every request (the served model's name).
      api_key_env: name of the environment variable holding the API key
        (None: no `Authorization` header, for local servers). It is read
        once, here; a named variable that is unset is an error.
      timeout_s: per-request socket timeout in seconds.
      max_retries: retries after the first attempt on connection errors,
        timeouts, HTTP 408/409/425/429 and 5xx.
      backoff_s: delay before the first retry; doubled at each further retry,
        capped at `backoff_max_s`. A 429's `Retry-After` header (seconds) is
        honoured up to the cap.
      backoff_max_s: the cap.
      extra_body: fields merged into every request body (e.g.
        `{"top_p": 0.95}` or vLLM's `{"chat_template_kwargs": {...}}`).

    Thread-safe: judges call one client from many threads.
    """

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None,
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 backoff_max_s: float = 8.0, extra_body: Mapping[str, Any] | None = None):
        self.url = _endpoint(base_url)
        if not isinstance(model, str) or not model:
            raise ValueError(f"model={model!r} must be the served model's name (non-empty str)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if max_retries < 0 or backoff_s < 0 or backoff_max_s < 0:
            raise ValueError(f"max_retries={max_retries}, backoff_s={backoff_s}, "
                             f"backoff_max_s={backoff_max_s} must be >= 0")
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.extra_body = dict(extra_body or {})
        self._api_key = self._read_key(api_key_env)
        self._lock = threading.Lock()
        self._stats = ChatClientStats()

    @staticmethod
    def _read_key(api_key_env: str | None) -> str | None:
        if api_key_env is None:
            return None
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(
                f"the environment variable {api_key_env!r} (api_key_env) is not set or empty; "
                "export it, or pass api_key_env=None for a server without authentication"
            )
        return key

    def __repr__(self) -> str:
        return (f"ChatClient(url={self.url!r}, model={self.model!r}, "
                f"api_key_env={self.api_key_env!r}, timeout_s={self.timeout_s}, "
                f"max_retries={self.max_retries})")

    @property
    def stats(self) -> ChatClientStats:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, temperature: float = 0.0,
             max_tokens: int = 1024, n: int = 1, stop: Sequence[str] | None = None) -> list[str]:
        """Sample `n` assistant replies to `messages`.

        Servers that return fewer than `n` choices (some ignore `n`) are asked
        again for the rest.

        Args:
          messages: OpenAI chat messages (`{"role", "content"}`).
          temperature, max_tokens, n, stop: the OpenAI sampling fields.

        Returns:
          `n` reply texts (a reply without text content reads as `""`).

        Raises:
          ChatClientError: the server could not be reached or answered with an
            error after the retries, or its answer is not a chat completion.
        """
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        replies: list[str] = []
        for _ in range(n):  # each round returns at least one choice
            body = {**self.extra_body, "model": self.model, "messages": list(messages),
                    "temperature": temperature, "max_tokens": max_tokens, "n": n - len(replies)}
            if stop:
                body["stop"] = list(stop)
            replies.extend(self._choices(self._post(body), body))
            if len(replies) >= n:
                break
        return replies[:n]

    def _describe(self, body: Mapping[str, Any]) -> str:
        return (f"POST {self.url} (model={self.model!r}, {len(body['messages'])} messages, "
                f"n={body['n']})")

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def _choices(self, response: Any, body: Mapping[str, Any]) -> list[str]:
        choices = response.get("choices") if isinstance(response, Mapping) else None
        if not isinstance(choices, list) or not choices:
            excerpt = self._scrub(json.dumps(response)[:_BODY_EXCERPT_CHARS])
            with self._lock:
                self._stats.failures += 1
            raise ChatClientError(
                f"{self._describe(body)} returned no 'choices' (not an OpenAI chat completion): "
                f"{excerpt}", url=self.url, status=200, attempts=1)
        usage = response.get("usage") if isinstance(response.get("usage"), Mapping) else {}
        with self._lock:
            self._stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self._stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        texts = []
        for choice in choices:
            message = choice.get("message") if isinstance(choice, Mapping) else None
            content = message.get("content") if isinstance(message, Mapping) else None
            texts.append(content if isinstance(content, str) else "")
        return texts

    def _request(self, body: Mapping[str, Any]) -> urllib.request.Request:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        return urllib.request.Request(self.url, data=data, headers=headers, method="POST")

    def _post(self, body: Mapping[str, Any]) -> Any:
        """POST with retries; the decoded JSON response."""
        request = self._request(body)
        attempt = 0
        while True:
            attempt += 1
            with self._lock:
                self._stats.requests += 1
            status, problem, retry_after = None, "", None
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
                return self._decode(raw, body, attempt)
            except urllib.error.HTTPError as err:
                status = err.code
                retry_after = err.headers.get("Retry-After") if err.headers else None
                problem = f"HTTP {err.code}: {self._error_excerpt(err)}"
                retryable = status in RETRY_STATUSES
            except TimeoutError:
                problem, retryable = f"timed out after {self.timeout_s:g} s", True
            except OSError as err:  # URLError, ConnectionError, ...
                reason = getattr(err, "reason", err)
                problem, retryable = f"connection error: {reason}", True
            if not retryable or attempt > self.max_retries:
                with self._lock:
                    self._stats.failures += 1
                raise ChatClientError(
                    f"{self._describe(body)} failed after {attempt} attempt(s): {problem}",
                    url=self.url, status=status, attempts=attempt) from None
            delay = self._delay(attempt, retry_after)
            logger.warning("%s: %s; retry %d/%d in %.2f s", self._describe(body), problem,
                           attempt, self.max_retries, delay)
            with self._lock:
                self._stats.retries += 1
            time.sleep(delay)

    def _decode(self, raw: bytes, body: Mapping[str, Any], attempt: int) -> Any:
        value, err = parse_json(raw.decode("utf-8", errors="replace"))
        if err is not None:
            excerpt = self._scrub(raw[:_BODY_EXCERPT_CHARS].decode("utf-8", errors="replace"))
            with self._lock:
                self._stats.failures += 1
            raise ChatClientError(
                f"{self._describe(body)} returned a body that is not JSON ({err}): {excerpt!r}",
                url=self.url, status=200, attempts=attempt)
        return value

    def _error_excerpt(self, err: urllib.error.HTTPError) -> str:
        try:
            text = err.read().decode("utf-8", errors="replace")
        except OSError:
            text = ""
        return self._scrub(text.strip()[:_BODY_EXCERPT_CHARS]) or err.reason or "no body"

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        delay = self.backoff_s * 2 ** (attempt - 1)
        if retry_after is not None:
            with contextlib.suppress(ValueError):  # an HTTP-date: the exponential delay stands
                delay = max(delay, float(retry_after))
        return min(delay, self.backoff_max_s)


def _strip_reasoning(text: str) -> str:
    """Text after the last `</think>` (Qwen3-style judges think first)."""
    return text.rsplit("</think>", 1)[-1]


def parse_json_reply(text: str | None) -> tuple[Any, str | None]:
    """The JSON object in an LLM reply, read leniently; never raises.

    Tries, in order: the reply after any `</think>`; the content of a
    ```` ```json ```` fence; the span from the first `{` to the last `}`.

    Returns:
      `(value, None)` with the decoded object (a dict), or `(None, reason)`.
    """
    text = _strip_reasoning(text or "").strip()
    if not text:
        return None, "empty reply"
    candidates = [text]
    if "```" in text:
        inner = text.split("```", 2)[1]
        candidates.append(inner[4:] if inner.lower().startswith("json") else inner)
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    error = None
    for candidate in candidates:
        candidate = candidate.strip()
        value, err = parse_json(candidate)
        if err is None and isinstance(value, dict):
            return value, None
        if err is None:
            error = error or f"expected a JSON object, got {type(value).__name__}"
        elif candidate.startswith(("{", "[")):
            error = error or err
    return None, error or "no JSON object found"
