"""A real HTTP server speaking OpenAI's `/v1/chat/completions`, with scripted replies.

It stands in for a remote LLM API (the judge / simulator endpoint), not for a
component agentrl ships: `ChatClient` talks to it over a real socket. Each
request takes the next scripted `Reply` (status, contents, delay, raw body,
headers); when the script is empty, `handler(request_body)` decides (default:
reply `"ok"`). Every request's headers and JSON body are recorded.
"""

import collections
import dataclasses
import http.server
import json
import threading
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Reply:
    """One scripted answer.

    contents: the choices' message contents (a str is repeated `n` times).
    status: HTTP status; non-200 sends `{"error": {"message": error}}`.
    delay_s: sleep before answering (timeouts).
    raw: a raw body sent instead of a chat completion (non-JSON bodies).
    headers: extra response headers (e.g. Retry-After).
    """

    contents: str | list[str] = "ok"
    status: int = 200
    delay_s: float = 0.0
    raw: bytes | None = None
    error: str = "scripted error"
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict


class ScriptedLLMServer:
    """`with ScriptedLLMServer() as server:` serves on 127.0.0.1 at `server.base_url`."""

    def __init__(self, handler: Callable[[dict], Reply | str | list[str]] | None = None):
        self.script: collections.deque[Reply] = collections.deque()
        self.handler = handler
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,),
                                        daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, *replies: Reply) -> None:
        self.script.extend(replies)

    def __enter__(self) -> "ScriptedLLMServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _next_reply(self, body: dict) -> Reply:
        with self._lock:
            if self.script:
                return self.script.popleft()
        if self.handler is None:
            return Reply()
        reply = self.handler(body)
        return reply if isinstance(reply, Reply) else Reply(contents=reply)

    def _handler_class(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with server._lock:
                    server.received.append(Received(self.path, dict(self.headers), body))
                if self.path != "/v1/chat/completions":
                    return self._send(404, json.dumps({"error": {"message": "not found"}}))
                reply = server._next_reply(body)
                time.sleep(reply.delay_s)
                if reply.raw is not None:
                    return self._send(reply.status, reply.raw, reply.headers)
                if reply.status != 200:
                    payload = json.dumps({"error": {"message": reply.error}})
                    return self._send(reply.status, payload, reply.headers)
                contents = reply.contents
                if isinstance(contents, str):
                    contents = [contents] * int(body.get("n", 1))
                return self._send(200, json.dumps(_completion(body, contents)), reply.headers)

            def _send(self, status, payload, headers=None):
                data = payload if isinstance(payload, bytes) else payload.encode("utf-8")
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for key, value in (headers or {}).items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

        return Handler


def _completion(body: dict, contents: list[str]) -> dict:
    return {
        "id": "chatcmpl-scripted", "object": "chat.completion", "created": 0,
        "model": body.get("model", ""),
        "choices": [{"index": i, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": content}}
                    for i, content in enumerate(contents)],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5 * len(contents),
                  "total_tokens": 10 + 5 * len(contents)},
    }


def last_user_content(body: dict) -> str:
    return body["messages"][-1]["content"]
