"""The HTTP edge over real sockets: idle connections, slow headers, stalled and cut-short bodies.

The real app is served by uvicorn with the server's own configuration (``uvicorn_config``) in a
thread of this process, on 127.0.0.1, so these are real TCP connections without a second process.
Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.server.cli import settings_from_args
from batchgen.server.connection_limits import uvicorn_config
from batchgen.server.log_limits import RepeatFilter
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import chat_line, jsonl

Serve = Callable[..., str]
BOUNDARY = "limits-boundary"


def _serve_in_thread(
    stack: ExitStack, storage: Path, *flags: str
) -> tuple[uvicorn.Server, threading.Thread, str]:
    """The app with these flags, served by uvicorn in a thread until ``stack`` closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    argv = ["--backend", "simulated", "--port", str(port), *flags]
    settings = settings_from_args([*argv, "--storage-path", str(storage)])
    app = in_process_app(storage, *argv)
    server = uvicorn.Server(uvicorn_config(app, settings))
    stack.callback(listener.close)  # last: after the server stopped serving it
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    stack.callback(thread.join, 30)
    stack.callback(setattr, server, "should_exit", True)
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Serve the app with these flags in a uvicorn thread; returns its base URL."""
    with ExitStack() as stack:

        def start(*flags: str) -> str:
            return _serve_in_thread(stack, tmp_path / "storage", *flags)[2]

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
    # all from 127.0.0.1: the per-address cap raised above them (tests/server/test_slow_clients.py)
    base_url = serve(
        "--max-connections", "400", "--header-timeout-s", "1", "--max-header-connections-per-address", "400"
    )  # fmt: skip
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


def test_at_its_cap_an_address_still_gets_bursts_of_whole_requests_in(serve: Serve) -> None:
    """4 connections from 127.0.0.1 wait for their heads (the cap): a burst of 30 more whose first
    bytes are whole requests are all answered, while one more that sends a partial head, or nothing,
    is closed long before the 60 s header timeout, and the 4 stay open."""
    base_url = serve("--max-header-connections-per-address", "4", "--header-timeout-s", "60")
    with ExitStack() as stack:
        waiting = [stack.enter_context(_connect(base_url)) for _ in range(4)]
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200  # they are in by now
        answers: list[bytes] = []

        def whole_request() -> None:
            with _connect(base_url) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answers.append(_read_all(sock))

        burst = [threading.Thread(target=whole_request) for _ in range(30)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(30)
        assert [_status(answer) for answer in answers] == [200] * 30
        partial = stack.enter_context(_connect(base_url))
        partial.sendall(b"GET /health HTTP/1.1\r\n")
        silent = stack.enter_context(_connect(base_url))
        assert _read_all(partial) == b"" and _read_all(silent) == b""
        for sock in waiting:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing to read, not closed
                sock.recv(1)


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


# --- request framing: the size of a request's head, and bodies framed two ways ----------------------

HEAD_LIMIT = 2048


def _head(size: int, *, headers: int = 1) -> bytes:
    """A ``GET /health`` whose request line and headers (with the empty line) are exactly ``size`` bytes,
    padded over ``headers`` header fields."""
    start = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    pads = [f"X-Pad-{index}: ".encode() for index in range(headers)]
    room = size - len(start) - sum(len(pad) + 2 for pad in pads) - 2
    assert room >= headers, "too small a head for that many fields"
    lengths = [room // headers + (1 if index < room % headers else 0) for index in range(headers)]
    head = (
        start
        + b"".join(pad + b"a" * length + b"\r\n" for pad, length in zip(pads, lengths, strict=True))
        + b"\r\n"
    )
    assert len(head) == size
    return head


def _send_in_pieces(sock: socket.socket, data: bytes, cuts: list[int]) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    position = 0
    for cut in [*sorted(cuts), len(data)]:
        if cut > position:
            sock.sendall(data[position:cut])
            position = cut
            time.sleep(0.002)


def _answer_to(base_url: str, data: bytes, cuts: list[int] | None = None) -> bytes:
    with _connect(base_url) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close before all is sent
            _send_in_pieces(sock, data, cuts or [])
        return _read_all(sock)


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def _refused(answer: bytes, status: int) -> dict[str, Any]:
    """The one response to a refused request: its status, an OpenAI-shaped error, and the connection
    closed (``_read_all`` ended), with no second response after it."""
    assert _status(answer) == status, answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1, f"a second request was served: {answer!r}"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


@pytest.mark.parametrize(
    "size", [HEAD_LIMIT - 1, HEAD_LIMIT, HEAD_LIMIT + 1, HEAD_LIMIT + 100, 3 * HEAD_LIMIT, 100_000]
)
@pytest.mark.parametrize("headers", [1, 20])
def test_the_head_size_limit_is_the_flag_exactly(serve: Serve, size: int, headers: int) -> None:
    base_url = serve("--max-header-bytes", str(HEAD_LIMIT))
    answer = _answer_to(base_url, _head(size, headers=headers))
    if size <= HEAD_LIMIT:
        assert _status(answer) == 200
    else:
        error = _refused(answer, 431)
        assert error["code"] == "request_header_too_large" and str(HEAD_LIMIT) in error["message"]


def test_a_100000_byte_header_is_refused_under_the_default_64_kib_limit(serve: Serve) -> None:
    base_url = serve()
    assert _status(_answer_to(base_url, _head(64 * 1024))) == 200
    _refused(_answer_to(base_url, _head(100_000)), 431)
    _refused(_answer_to(base_url, _head(64 * 1024 + 1)), 431)


def test_the_head_size_limit_holds_however_the_bytes_arrive(serve: Serve) -> None:
    """Any head size near the limit, sent in any pieces, with a body behind it or not: the verdict
    depends on the head's size alone."""
    base_url = serve("--max-header-bytes", str(HEAD_LIMIT))

    @settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        size=st.integers(HEAD_LIMIT - 200, HEAD_LIMIT + 200),
        headers=st.integers(1, 8),
        cuts=st.lists(st.integers(0, HEAD_LIMIT + 200), max_size=4),
        body=st.sampled_from([b"", b"x" * 5000]),
    )
    def check(size: int, headers: int, cuts: list[int], body: bytes) -> None:
        head = _head(size, headers=headers)
        if body:  # the body's bytes, arriving with the head, do not count towards it
            head = head[:-2] + f"Content-Length: {len(body)}\r\n\r\n".encode()
            size = len(head)
        answer = _answer_to(base_url, head + body, cuts)
        if size <= HEAD_LIMIT:
            assert _status(answer) in (200, 405)  # a GET /health with a body may be refused by the route
        else:
            _refused(answer, 431)

    check()


def test_a_client_still_sending_after_a_refusal_reads_the_refusal_not_a_reset(serve: Serve) -> None:
    """A head too large with a body behind it, sent at once: the server refuses after its first read,
    with the rest of the body still unread in the socket. Closing such a socket would reset the
    connection (the client may lose the answer); the server instead stops sending, drops what still
    arrives for a moment, then closes, and the client reads the refusal."""
    base_url = serve("--max-header-bytes", str(HEAD_LIMIT))
    body = b"x" * 600_000  # more than one read of the server's, less than what it drops at most
    head = _head(HEAD_LIMIT + 100)[:-2] + f"Content-Length: {len(body)}\r\n\r\n".encode()
    for _ in range(3):
        with _connect(base_url) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(head + body)
            _refused(_read_all(sock), 431)


def test_an_answer_given_before_the_body_was_read_is_read_not_reset(serve: Serve) -> None:
    """``GET /health`` with a body and ``Connection: close``: the route answers without reading the
    body, and the server closes with most of it unread in the socket; the close lingers, so the
    client reads the answer."""
    base_url = serve()
    body = b"x" * 600_000
    head = (
        f"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    for _ in range(3):
        with _connect(base_url) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(head + body)
            assert _status(_read_all(sock)) in (200, 405)


_SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def _framed(*header_lines: str, body: bytes = b"0\r\n\r\n" + _SMUGGLED) -> bytes:
    head = "POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return (head + "".join(f"{line}\r\n" for line in header_lines) + "\r\n").encode() + body


@pytest.mark.parametrize(
    "lines",
    [
        ("Content-Length: 5", "Transfer-Encoding: chunked"),
        ("Transfer-Encoding: chunked", "Content-Length: 5"),
        ("content-length: 44", "transfer-encoding: chunked"),
        ("TRANSFER-ENCODING: CHUNKED", "CONTENT-LENGTH: 0"),
        ("Transfer-Encoding: Chunked", "Content-length: 3"),
        ("Content-Length: 5", "Transfer-Encoding:   chunked  "),
        ("Content-Length: 5", "Content-Length: 5", "Transfer-Encoding: chunked"),
    ],
    ids=lambda lines: " | ".join(lines),
)
def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
    serve: Serve, lines: tuple[str, ...]
) -> None:
    """RFC 9112 section 6.1: a proxy in front could read the body by the other header, so the bytes
    after it (here a second request) must never run."""
    base_url = serve()
    error = _refused(_answer_to(base_url, _framed(*lines)), 400)
    assert "Content-Length" in error["message"] and "Transfer-Encoding" in error["message"]


@pytest.mark.parametrize(
    "lines",
    [
        ("Content-Length: 5", "Content-Length: 6"),
        ("Content-Length: 5, 6",),
        ("Content-Length: -5",),
        ("Content-Length: 0x10",),
        ("Transfer-Encoding: gzip, chunked",),
        ("Transfer-Encoding: chunked", "Transfer-Encoding: chunked"),
        ("Transfer-Encoding: identity",),
        ("Content-Length : 5",),
        ("Transfer-Encoding: chunked, gzip",),
        ("Transfer-Encoding: gzip",),
        ("X-Folded: a", " Transfer-Encoding: chunked", "Content-Length: 5"),
        ("Content-Length: 5", "X-Folded: a", "\tb"),
        ("Transfer-Encoding: \x0bchunked", "Content-Length: 5"),
    ],
    ids=lambda lines: " | ".join(lines),
)
def test_other_ambiguous_framing_is_refused_and_the_connection_closed(
    serve: Serve, lines: tuple[str, ...]
) -> None:
    base_url = serve()
    _refused(_answer_to(base_url, _framed(*lines)), 400)


def test_requests_framed_one_way_still_share_a_connection(serve: Serve) -> None:
    base_url = serve()
    chunked = "POST /v1/batches HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    sized = "POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    answer = _answer_to(base_url, (chunked + sized).encode())
    assert answer.count(b"HTTP/1.1 400 ") == 2, answer  # both reached the app (no input_file_id)


def test_a_request_under_way_at_shutdown_is_cut_with_503_when_the_grace_ends(tmp_path: Path) -> None:
    """The server stops (as on SIGTERM): a finished request's connection closes at once, an upload
    still arriving gets until ``--shutdown-grace-s``, then 503 and the close; its staging file goes."""
    storage = tmp_path / "storage"
    with ExitStack() as stack:
        server, thread, base_url = _serve_in_thread(stack, storage, "--shutdown-grace-s", "1")
        start = _multipart_start() + jsonl(chat_line("g1"))
        slow = stack.enter_context(_connect(base_url))
        slow.sendall(_upload_head(len(start) + 10_000) + start)  # then a byte now and then
        idle = stack.enter_context(_connect(base_url))
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b"}"):  # the whole answer; the connection stays open (keep-alive)
            first += idle.recv(65536)
        assert _status(first) == 200
        deadline = time.monotonic() + 10
        while not list((storage / "staging").iterdir()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stopped_at = time.monotonic()
        server.should_exit = True
        assert _read_all(idle) == b"", "an idle connection is closed at once by the shutdown"
        with contextlib.suppress(OSError):  # keep the upload going until the server answers
            while thread.is_alive() and not select.select([slow], [], [], 0.2)[0]:
                assert time.monotonic() - stopped_at < 15, "the shutdown waits for the upload"
                slow.sendall(b" ")
        answer = _read_all(slow)
        thread.join(10)
        assert not thread.is_alive(), "the shutdown did not end"
        assert time.monotonic() - stopped_at >= 0.9, "the upload was cut before the grace ended"
    error = _refused(answer, 503)
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert b"retry-after: 5" in answer.lower()
    assert list((storage / "staging").iterdir()) == [], "the cut upload left its staging file"
