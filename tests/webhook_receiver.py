"""A real webhook receiver for tests: a threaded HTTP server on 127.0.0.1 that records every POST.

It answers 500 to the first ``fail_first`` requests, then 204, and keeps every request it got
(headers and body) in order. With ``drip`` it is a slow receiver instead: it answers every request
a byte at a time, one each ``drip_s``, either the body (``"body"``: the status line and headers at
once, then a long body) or the headers themselves (``"headers"``); it never finishes an answer in
a test's time, and counts in ``hangups`` the requests whose sender hung up on it meanwhile.
``delay_s`` holds each answer that long; ``most_at_once`` is the most requests it held at once. ``verify`` checks a Standard Webhooks signature with its own code
(hmac over ``{id}.{timestamp}.{body}``), written apart from the server's, so a test checks the
server against the spec rather than against itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs


@attrs.frozen
class Received:
    headers: dict[str, str]
    body: bytes
    answered: int

    def event(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed


def verify(secret: str, received: Received) -> bool:
    """Whether ``received`` carries a valid ``v1`` signature for ``secret`` (``whsec_`` + base64)."""
    key = base64.b64decode(secret.split("_", 1)[1]) if secret.startswith("whsec_") else secret.encode()
    message_id = received.headers["webhook-id"]
    timestamp = received.headers["webhook-timestamp"]
    expected = hmac.new(key, f"{message_id}.{timestamp}.".encode() + received.body, hashlib.sha256).digest()
    offered = [
        base64.b64decode(part.split(",", 1)[1])
        for part in received.headers.get("webhook-signature", "").split()
        if part.startswith("v1,")
    ]
    return any(hmac.compare_digest(expected, signature) for signature in offered)


class WebhookReceiver:
    """Listens on ``port`` (a free one when 0) until ``close``."""

    def __init__(
        self,
        port: int = 0,
        *,
        fail_first: int = 0,
        delay_s: float = 0.0,
        drip: str | None = None,
        drip_s: float = 0.2,
    ) -> None:
        assert drip in (None, "body", "headers")
        self.fail_first = fail_first
        self.received: list[Received] = []
        self.hangups = 0
        self.at_once = 0
        self.most_at_once = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if drip is not None:
                    self._drip(body)
                    return
                with receiver._lock:
                    receiver.at_once += 1
                    receiver.most_at_once = max(receiver.most_at_once, receiver.at_once)
                time.sleep(delay_s)
                with receiver._lock:
                    receiver.at_once -= 1
                    status = 500 if len(receiver.received) < receiver.fail_first else 204
                    headers = {name.lower(): value for name, value in self.headers.items()}
                    receiver.received.append(Received(headers, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def _drip(self, body: bytes) -> None:
                headers = {name.lower(): value for name, value in self.headers.items()}
                with receiver._lock:
                    receiver.received.append(Received(headers, body, 0))  # 0: never answered
                size = 100_000
                answer = f"HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n".encode()
                start = b"" if drip == "headers" else answer
                rest = answer if drip == "headers" else b"x" * size
                try:
                    self.wfile.write(start)
                    self.wfile.flush()
                    for byte in rest:
                        if receiver._closing.wait(drip_s):
                            return
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                except OSError:  # the sender hung up
                    with receiver._lock:
                        receiver.hangups += 1
                self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks/batchgen"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def delivered(self) -> list[Received]:
        with self._lock:
            return [request for request in self.received if 200 <= request.answered < 300]

    def wait_for_deliveries(self, count: int, timeout_s: float = 60.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            delivered = self.delivered()
            if len(delivered) >= count:
                return delivered
            time.sleep(0.05)
        raise AssertionError(f"{len(self.delivered())} of {count} webhooks delivered; got {self.received}")

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
