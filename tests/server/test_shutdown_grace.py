"""``--shutdown-grace-s`` bounds the whole shutdown of a real ``batchgen-server`` process.

On SIGTERM (or SIGINT) the server stops admitting requests; HTTP requests under way and requests
running on the model share one grace period. Uploads still arriving when it ends are cut and their
staging files removed; a request that finishes inside it is answered; the process exits 0. The
uploads here are raw sockets that send a multipart body a few bytes at a time.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import chat_line, create_batch, jsonl, upload, wait_for_status
from tests.live import LiveServer

BOUNDARY = "grace-boundary"
#: How long past the grace the process may take to exit: the cut, the service's stop, Python's exit.
EXIT_MARGIN_S = 6.0


def _multipart(content: bytes) -> tuple[bytes, bytes]:
    """The multipart body of an upload of ``content``, split before its closing boundary."""
    start = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode() + content
    return start, f"\r\n--{BOUNDARY}--\r\n".encode()


def _head(base_url: str, length: int) -> tuple[socket.socket, bytes]:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
    ).encode()
    return sock, head


class SlowUpload(threading.Thread):
    """An upload that sends its head and first bytes, then a few bytes every 0.2 s for a minute."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        start, _ = _multipart(jsonl(chat_line("slow")))
        self.sock, head = _head(base_url, len(start) + 10_000_000)
        self.sock.sendall(head + start)
        self.cut = threading.Event()
        self.answer = b""

    def run(self) -> None:
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                self.sock.sendall(b" " * 16)
                time.sleep(0.2)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            self.sock.settimeout(5)
            while chunk := self.sock.recv(65536):
                self.answer += chunk
        self.cut.set()
        self.sock.close()


def _staging(storage: Path) -> list[Path]:
    return sorted((storage / "staging").iterdir())


def _wait_for(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _stop(server: LiveServer, stop_signal: signal.Signals, within_s: float) -> float:
    """Send ``stop_signal``; the seconds until the process exited (it must exit 0 within ``within_s``)."""
    started = time.monotonic()
    server.process.send_signal(stop_signal)
    try:
        server.process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError(
            f"still running {within_s} s after {stop_signal.name}:\n{server.log_path.read_text()}"
        ) from None
    elapsed = time.monotonic() - started
    assert server.process.returncode == 0, server.log_path.read_text()
    return elapsed


@pytest.fixture
def slow_uploads() -> Iterator[list[SlowUpload]]:
    uploads: list[SlowUpload] = []
    yield uploads
    for each in uploads:
        with contextlib.suppress(OSError):
            each.sock.close()


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_uploads_still_arriving_are_cut_at_the_end_of_the_grace(
    server_factory: Callable[..., LiveServer], slow_uploads: list[SlowUpload], stop_signal: signal.Signals
) -> None:
    grace_s = 2.0
    server = server_factory("--shutdown-grace-s", str(grace_s))
    slow_uploads.extend(SlowUpload(server.base_url) for _ in range(3))
    for each in slow_uploads:
        each.start()
    # an upload under way that finishes inside the grace is answered
    start, end = _multipart(jsonl(chat_line("fast")))
    fast, head = _head(server.base_url, len(start) + len(end))
    fast.sendall(head + start)
    _wait_for(lambda: len(_staging(server.storage_path)) == 4)

    finisher = threading.Timer(0.5, fast.sendall, [end])
    finisher.start()
    elapsed = _stop(server, stop_signal, within_s=grace_s + EXIT_MARGIN_S)
    finisher.join()

    fast.settimeout(10)
    answer = fast.recv(65536)
    fast.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert b'"object":"file"' in answer.replace(b" ", b"")
    for each in slow_uploads:
        assert each.cut.wait(10), "a slow upload was not cut"
        # the cut answers 503 before it closes (a client still sending may only see the close)
        assert each.answer == b"" or each.answer.startswith(b"HTTP/1.1 503 "), each.answer
        assert each.answer == b"" or b"server_shutting_down" in each.answer
    assert _staging(server.storage_path) == [], "a cut upload left its staging file"
    assert elapsed >= grace_s - 0.5, "the uploads were cut before the grace ended"


def test_model_requests_and_uploads_share_one_grace(
    server_factory: Callable[..., LiveServer], slow_uploads: list[SlowUpload]
) -> None:
    """Requests running on the model do not get a grace of their own after the HTTP one: the
    whole shutdown ends about ``--shutdown-grace-s`` after the signal."""
    grace_s = 5.0
    server = server_factory("--shutdown-grace-s", str(grace_s), "--simulated-latency-s", "120")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch_id = create_batch(client, upload(client, jsonl(*[chat_line(f"m{i}") for i in range(4)]))["id"])[
            "id"
        ]
        wait_for_status(client, batch_id, {"in_progress"})
        _wait_for(lambda: client.get("/v1/pool/status").json()["scheduling_pool_active"] == 4)
    slow_uploads.append(SlowUpload(server.base_url))
    slow_uploads[0].start()
    _wait_for(lambda: len(_staging(server.storage_path)) == 1)

    elapsed = _stop(server, signal.SIGTERM, within_s=2 * grace_s + EXIT_MARGIN_S)
    assert elapsed < 2 * grace_s - 1, f"the model's grace came after the HTTP one ({elapsed:.1f} s)"
    assert _staging(server.storage_path) == []
    log = server.log_path.read_text()
    assert "still running; they will rerun" in log or "they will rerun" in log, log

    again = server_factory("--simulated-latency-s", "0.01")
    with httpx.Client(base_url=again.base_url, timeout=30) as client:
        ended = wait_for_status(client, batch_id, {"completed"}, timeout_s=60)
    assert ended["request_counts"]["completed"] == 4, "the abandoned requests ran again"
