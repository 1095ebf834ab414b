"""A flaky HTTP proxy for live client tests: scripted failures in front of a real server.

    with FlakyProxy(server.base_url) as proxy:
        proxy.fail("POST", "/v1/files", Reply(503), Reply(503))
        proxy.fail("POST", "/v1/batches", DROP_AFTER_FORWARDING)
        client = BatchGenHttpClient(proxy.base_url)

Each (method, path) has a queue of failures, used one per request; once a queue is empty,
requests are forwarded to the server and its answer is relayed. `DROP_AFTER_FORWARDING` forwards
the request (the server acts on it) and then closes the connection without answering, as when a
response is lost on the way back. Every request is recorded in `requests`.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import httpx

__all__ = ["DROP_AFTER_FORWARDING", "FlakyProxy", "Reply", "Seen"]

# Not passed on: hop-by-hop headers, and those the proxy sets itself or that no longer hold
# (httpx hands the proxy a decoded body).
_NOT_RELAYED = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "host",
    "date",
    "server",
}


@dataclass(frozen=True)
class Reply:
    """A scripted answer."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b'{"error": {"message": "scripted failure", "type": "server_error", "code": null}}'


DROP_AFTER_FORWARDING = object()


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    answer: str  # "forwarded", "dropped" or the scripted status


class FlakyProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.requests: list[Seen] = []
        self._failures: dict[tuple[str, str], deque[Any]] = defaultdict(deque)
        self._lock = threading.Lock()
        self._http = httpx.Client(base_url=upstream, timeout=30)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def fail(self, method: str, path: str, *failures: Any) -> None:
        with self._lock:
            self._failures[(method, path)].extend(failures)

    def seen(self, method: str, path: str) -> list[Seen]:
        return [r for r in self.requests if (r.method, r.path) == (method, path)]

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()

    def _next_failure(self, method: str, path: str) -> Any:
        with self._lock:
            queue = self._failures.get((method, path))
            return queue.popleft() if queue else None

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_RELAYED}
                failure = proxy._next_failure(self.command, path)

                def record(answer: str) -> None:  # before answering: the client may check at once
                    proxy.requests.append(Seen(self.command, path, headers, body, answer))

                if isinstance(failure, Reply):
                    record(str(failure.status))
                    self._answer(failure.status, failure.headers, failure.body)
                    return
                upstream = proxy._http.request(self.command, self.path, headers=headers, content=body)
                if failure is DROP_AFTER_FORWARDING:
                    record("dropped")
                    self.close_connection = True  # no response at all
                    return
                record("forwarded")
                relayed = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED}
                self._answer(upstream.status_code, relayed, upstream.content)

            def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _handle

        return Handler
