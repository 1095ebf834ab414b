"""A real webhook receiver for tests: a threaded HTTP server on 127.0.0.1 that records every POST.

It answers 500 to the first ``fail_first`` requests, then 204, and keeps every request it got
(headers and body) in order. ``verify`` checks a Standard Webhooks signature with its own code
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

    def __init__(self, port: int = 0, *, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.received: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._lock:
                    status = 500 if len(receiver.received) < receiver.fail_first else 204
                    headers = {name.lower(): value for name, value in self.headers.items()}
                    receiver.received.append(Received(headers, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

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
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
