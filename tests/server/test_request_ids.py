"""Request ids: every response of a real ``batchgen-server`` carries its own ``x-request-id``, the
openai SDK shows it as ``_request_id``, and the request's access log line names the same id.

Refusals written before a request reaches a route (the connection limit, a head too large,
ambiguous framing, a body too large, an unknown or odd path, a method the route does not take)
are covered over real sockets. Every route of the app is swept in ``test_route_access``.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import chat_line, jsonl, wait_for_status
from tests.live import LiveServer

pytestmark = pytest.mark.live

ServerFactory = Callable[..., LiveServer]
REQUEST_ID = re.compile(r"req_[0-9a-f]{32}")


def _access_lines(server: LiveServer, ids: set[str], timeout_s: float = 30) -> dict[str, dict[str, object]]:
    """The JSON access log lines naming ``ids``, by id, once all of them are in the log."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, dict[str, object]] = {}
        for line in server.log_path.read_text().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("event") == "http.request" and entry.get("request_id") in ids:
                    found[str(entry["request_id"])] = entry
        if set(found) == ids or time.monotonic() > deadline:
            assert set(found) == ids, f"not in the access log: {ids - set(found)}"
            return found
        time.sleep(0.05)


def _exchange(base_url: str, request: bytes) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _status_and_id(answer: bytes) -> tuple[int, str]:
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = [line.partition(":") for line in head[1:]]
    ids = [value.strip() for name, _, value in headers if name.lower() == "x-request-id"]
    assert len(ids) == 1, head
    return int(head[0].split(" ", 2)[1]), ids[0]


@pytest.fixture
def logged_server(server_factory: ServerFactory) -> LiveServer:
    return server_factory(
        "--log-level", "info", "--log-format", "json", "--access-log",
        "--max-upload-bytes", "4096", "--max-header-bytes", "4096", "--max-connections", "8",
        "--header-timeout-s", "60",
    )  # fmt: skip


@pytest.fixture
def sdk(logged_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=logged_server.api_url, api_key="unused", max_retries=0) as client:
        yield client


def test_the_sdk_shows_a_unique_request_id_that_the_access_log_names(
    logged_server: LiveServer, sdk: openai.OpenAI, tmp_path: Path
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl(chat_line("a"), chat_line("b")))
    with requests.open("rb") as handle:
        uploaded = sdk.files.create(file=handle, purpose="batch")
    created = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with httpx.Client(base_url=logged_server.base_url, timeout=30) as client:
        wait_for_status(client, created.id, {"completed"})
    retrieved = sdk.batches.retrieve(created.id)
    listed = sdk.batches.list()
    files = sdk.files.list()
    file = sdk.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.batches.retrieve("batch_missing")
    answered: dict[tuple[str, str, int], str | None] = {
        ("POST", "/v1/files", 200): uploaded._request_id,
        ("POST", "/v1/batches", 200): created._request_id,
        ("GET", f"/v1/batches/{created.id}", 200): retrieved._request_id,
        ("GET", "/v1/batches", 200): listed._request_id,
        ("GET", "/v1/files", 200): files._request_id,
        ("GET", f"/v1/files/{uploaded.id}", 200): file._request_id,
        ("GET", "/v1/batches/batch_missing", 404): missing.value.request_id,
    }
    ids = {str(each) for each in answered.values()}
    assert all(REQUEST_ID.fullmatch(each) for each in ids), answered
    assert len(ids) == len(answered), "a request id named two requests"
    logged = _access_lines(logged_server, ids)
    for (method, path, status), named in answered.items():
        request_id = str(named)
        assert (logged[request_id]["method"], logged[request_id]["path"]) == (method, path)
        assert logged[request_id]["status"] == status


def test_every_refusal_before_routing_names_its_request_in_the_header_and_the_log(
    logged_server: LiveServer,
) -> None:
    base = logged_server.base_url
    answers: dict[str, tuple[int, str]] = {}
    answers["head too large"] = _status_and_id(
        _exchange(base, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n")
    )
    answers["ambiguous framing"] = _status_and_id(
        _exchange(
            base,
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        )
    )
    answers["odd path"] = _status_and_id(
        _exchange(base, b"GET //v1/files HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    )
    with httpx.Client(base_url=base, timeout=30) as client:
        for name, response in {
            "unknown path": client.get("/v1/nowhere"),
            "method not allowed": client.delete("/health"),
            "HEAD": client.head("/"),
            "body too large": client.post(
                "/v1/files", files={"file": ("big.jsonl", b"x" * 8192)}, data={"purpose": "batch"}
            ),
            "client's own id": client.get("/health", headers={"x-request-id": "req_mine"}),
        }.items():
            answers[name] = (response.status_code, response.headers["x-request-id"])
    with ExitStack() as stack:
        host, port = base.removeprefix("http://").split(":")
        for _ in range(12):  # more idle connections than --max-connections allows
            stack.enter_context(socket.create_connection((host, int(port)), timeout=30))
        answers["connection limit"] = _status_and_id(
            _exchange(base, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        )

    statuses = {name: status for name, (status, _) in answers.items()}
    assert statuses == {
        "head too large": 431,
        "ambiguous framing": 400,
        "odd path": 404,
        "unknown path": 404,
        "method not allowed": 405,
        "HEAD": 200,
        "body too large": 413,
        "client's own id": 200,
        "connection limit": 503,
    }
    ids = {request_id for _, request_id in answers.values()}
    assert all(REQUEST_ID.fullmatch(each) for each in ids) and len(ids) == len(answers), answers
    logged = _access_lines(logged_server, ids)
    assert {name: logged[request_id]["status"] for name, (_, request_id) in answers.items()} == statuses
