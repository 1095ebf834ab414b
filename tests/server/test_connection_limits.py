"""The HTTP edge over real sockets: idle connections, slow headers, stalled and cut-short bodies.

The real app is served by uvicorn with the server's own configuration (``uvicorn_config``) in a
thread of this process, on 127.0.0.1, so these are real TCP connections without a second process.
Every wait is bounded.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import uvicorn

from batchgen.server.cli import settings_from_args
from batchgen.server.connection_limits import uvicorn_config
from batchgen.server.log_limits import RepeatFilter
from tests.conftest import in_process_app
from tests.helpers import chat_line, jsonl

Serve = Callable[..., str]
BOUNDARY = "limits-boundary"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Serve the app with these flags in a uvicorn thread; returns its base URL."""
    with ExitStack() as stack:

        def start(*flags: str) -> str:
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            port = listener.getsockname()[1]
            argv = ["--backend", "simulated", "--port", str(port), *flags]
            settings = settings_from_args([*argv, "--storage-path", str(tmp_path / "storage")])
            app = in_process_app(tmp_path / "storage", *argv)
            server = uvicorn.Server(uvicorn_config(app, settings))
            thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
            thread.start()
            stack.callback(thread.join, 30)
            stack.callback(setattr, server, "should_exit", True)
            stack.callback(listener.close)
            deadline = time.monotonic() + 30
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.started
            return f"http://127.0.0.1:{port}"

        yield start


def _connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_all(sock: socket.socket, timeout_s: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_health_answers_beside_hundreds_of_idle_sockets_and_idle_ones_are_closed(serve: Serve) -> None:
    base_url = serve("--max-connections", "400", "--header-timeout-s", "1")
    with ExitStack() as stack:
        idle = [stack.enter_context(_connect(base_url)) for _ in range(300)]
        slow = stack.enter_context(_connect(base_url))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
        # the header timeout closes what never sent a whole request: recv sees the end (b"")
        assert _read_all(idle[0]) == b"" and _read_all(idle[-1]) == b""
        assert _read_all(slow) == b""
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200


def test_connections_beyond_the_limit_get_503(serve: Serve) -> None:
    base_url = serve("--max-connections", "20", "--header-timeout-s", "30")
    with ExitStack() as stack:
        for _ in range(25):
            stack.enter_context(_connect(base_url))
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 503


def _upload_head(total_length: int) -> bytes:
    return (
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: {total_length}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
    ).encode()


def _multipart_start() -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    ).encode()


def test_a_stalled_upload_is_cut_with_408_and_leaves_nothing(serve: Serve, tmp_path: Path) -> None:
    base_url = serve("--body-timeout-s", "1")
    with _connect(base_url) as sock:
        start = _multipart_start() + jsonl(chat_line("s1"))
        sock.sendall(_upload_head(len(start) + 10_000) + start)  # then nothing more
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"request_timeout" in answer and b"stalled" in answer
    assert httpx.get(f"{base_url}/v1/files", timeout=10).json()["data"] == []
    assert list((tmp_path / "storage" / "staging").iterdir()) == []


def test_a_chunked_upload_ending_early_is_400(serve: Serve) -> None:
    base_url = serve()
    with _connect(base_url) as sock:
        part = _multipart_start() + jsonl(chat_line("c1"), chat_line("c2"))
        head = (
            "POST /v1/files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
        ).encode()
        sock.sendall(head + f"{len(part):x}\r\n".encode() + part + b"\r\n0\r\n\r\n")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"cut short" in answer
    assert httpx.get(f"{base_url}/v1/files", timeout=10).json()["data"] == []


def test_an_empty_output_file_leaves_the_connection_usable(serve: Serve) -> None:
    base_url = serve("--simulated-latency-s", "30", "--shutdown-grace-s", "0")
    with httpx.Client(base_url=base_url, timeout=10) as client:
        file_id = client.post(
            "/v1/files", files={"file": ("in.jsonl", jsonl(chat_line("e")))}, data={"purpose": "batch"}
        ).json()["id"]
        batch = client.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        )
        batch_id = batch.json()["id"]
        deadline = time.monotonic() + 30
        while (output := client.get(f"/v1/batches/{batch_id}").json()["output_file_id"]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with _connect(base_url) as sock:  # two requests on one connection
        request = f"GET /v1/files/{output}/content HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        sock.sendall(request + request[:-2] + b"Connection: close\r\n\r\n")
        answer = _read_all(sock)
    assert answer.count(b"HTTP/1.1 200 OK") == 2 and answer.count(b"content-length: 0") == 2
    httpx.post(f"{base_url}/v1/batches/{batch_id}/cancel", timeout=10)


def test_repeated_log_records_are_limited_and_counted() -> None:
    now = [0.0]
    repeat_filter = RepeatFilter(limit=3, interval_s=10, clock=lambda: now[0])

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("batchgen", logging.ERROR, "/x.py", 7, message, None, None)

    passed = [repeat_filter.filter(record("disk full")) for _ in range(100)]
    assert passed == [True] * 3 + [False] * 97
    assert repeat_filter.filter(record("another message"))  # another kind has its own budget
    now[0] = 10.0
    next_one = record("disk full")
    assert repeat_filter.filter(next_one) and "97 more like this were suppressed" in next_one.getMessage()
