"""batchgen.client's sync and async clients driven through httpx.MockTransport (no server).

Scripted handlers check retries, headers and bodies; `FakeServer` is a small in-memory stand-in
for the REST API (files, batches going validating → in_progress → completed) for submit_batch.
"""

from __future__ import annotations

import email.policy
import io
import json
import logging
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import httpx
import pytest

import batchgen
import batchgen.batchgen_client
import batchgen.client
from batchgen.client import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AsyncBatchGenClient,
    BatchFailed,
    BatchGenClientError,
    BatchGenHttpClient,
    BatchWaitTimeout,
    RetriesExhausted,
    RetryPolicy,
)

BASE = "http://batchgen.test"


# --- helpers ------------------------------------------------------------------------------------


class Sleeps(list[float]):
    """Records the client's waits instead of sleeping."""

    def sleep(self, seconds: float) -> None:
        self.append(seconds)

    async def async_sleep(self, seconds: float) -> None:
        self.append(seconds)

    def policy(self, **kwargs: Any) -> RetryPolicy:
        return RetryPolicy(sleep=self.sleep, async_sleep=self.async_sleep, **kwargs)


Reply = tuple[int, Any] | tuple[int, Any, dict[str, str]]


class Script:
    """A handler answering with the given (status, json[, headers]) in turn; the last repeats."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        status, body = reply[0], reply[1]
        headers: dict[str, str] = reply[2] if len(reply) == 3 else {}
        if isinstance(body, bytes):
            return httpx.Response(status, content=body, headers=headers)
        return httpx.Response(status, json=body, headers=headers)


def error_body(message: str, code: str, type_: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": "input_file_id", "code": code}}


FULL = error_body("Intake pool is full", "capacity_exceeded", "rate_limit_error")
UNAVAILABLE = error_body("Server unhealthy", "service_unavailable", "server_error")


def multipart_fields(request: httpx.Request) -> dict[str, tuple[str | None, bytes]]:
    """The fields of a multipart/form-data request: name -> (filename, content)."""
    header = b"Content-Type: " + request.headers["content-type"].encode() + b"\r\n\r\n"
    message = BytesParser(policy=email.policy.HTTP).parsebytes(header + request.content)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        content = part.get_payload(decode=True)
        assert isinstance(name, str) and isinstance(content, bytes)
        fields[name] = (part.get_filename(), content)
    return fields


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def requests_file(tmp_path: Path, url: str = "/v1/chat/completions", n: int = 3) -> Path:
    rows = []
    for i in range(n):
        body: dict[str, Any]
        if url == "/v1/completions":
            body = {"model": "m", "prompt": f"count to {i}"}
        else:
            body = {"model": "m", "messages": [{"role": "user", "content": f"count to {i}"}]}
        rows.append({"custom_id": f"request-{i}", "method": "POST", "url": url, "body": body})
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl(rows))
    return path


class FakeServer:
    """In-memory files and batches behind the REST paths the client uses.

    A new batch is `validating`; each GET of it moves it along `lifecycle`. On reaching the
    final status it writes the output file: one result line per input line (and an error file
    if `fail_custom_ids` names any). An upload or create with an `Idempotency-Key` seen before
    returns the object the first one made.
    """

    def __init__(
        self,
        lifecycle: tuple[str, ...] = ("validating", "in_progress", "completed"),
        fail_custom_ids: frozenset[str] = frozenset(),
    ) -> None:
        self.lifecycle = lifecycle
        self.fail_custom_ids = fail_custom_ids
        self.files: dict[str, dict[str, Any]] = {}
        self.contents: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.polls: dict[str, int] = {}
        self.seen_statuses: list[str] = []
        self.create_bodies: list[dict[str, Any]] = []
        self.requests: list[httpx.Request] = []
        self.made_by_key: dict[str, dict[str, Any]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        method, parts = request.method, request.url.path.strip("/").split("/")
        key = request.headers.get("idempotency-key")
        if method == "POST" and key in self.made_by_key:
            return httpx.Response(200, json=self.made_by_key[key])
        response = self._route(request, method, parts)
        if method == "POST" and key is not None and response.status_code == 200:
            self.made_by_key[key] = response.json()
        return response

    def _route(self, request: httpx.Request, method: str, parts: list[str]) -> httpx.Response:
        if (method, parts) == ("POST", ["v1", "files"]):
            fields = multipart_fields(request)
            filename, content = fields["file"]
            file_obj = self._add_file(filename or "upload", content, fields["purpose"][1].decode())
            return httpx.Response(200, json=file_obj)
        if method == "GET" and parts[:2] == ["v1", "files"] and len(parts) == 4:
            if parts[2] not in self.contents:
                return httpx.Response(404, json=error_body("No such file", "not_found"))
            return httpx.Response(200, content=self.contents[parts[2]])
        if (method, parts) == ("POST", ["v1", "batches"]):
            body = json.loads(request.content)
            self.create_bodies.append(body)
            batch_id = f"batch_{len(self.batches) + 1}"
            batch = {
                "id": batch_id,
                "object": "batch",
                "endpoint": body["endpoint"],
                "input_file_id": body["input_file_id"],
                "status": "validating",
                "output_file_id": None,
                "error_file_id": None,
            }
            self.batches[batch_id] = batch
            self.polls[batch_id] = 0
            return httpx.Response(200, json=batch)
        if method == "GET" and parts[:2] == ["v1", "batches"] and len(parts) == 3:
            return httpx.Response(200, json=self._poll(parts[2]))
        return httpx.Response(404, json=error_body(f"no route {method} {parts}", "not_found"))

    def _add_file(self, filename: str, content: bytes, purpose: str) -> dict[str, Any]:
        file_id = f"file-{len(self.files) + 1}"
        obj = {"id": file_id, "object": "file", "bytes": len(content), "filename": filename}
        self.files[file_id] = obj | {"purpose": purpose}
        self.contents[file_id] = content
        return self.files[file_id]

    def _poll(self, batch_id: str) -> dict[str, Any]:
        batch = self.batches[batch_id]
        step = min(self.polls[batch_id], len(self.lifecycle) - 1)
        self.polls[batch_id] += 1
        status = self.lifecycle[step]
        if status != batch["status"] or not self.seen_statuses:
            self.seen_statuses.append(status)
        batch["status"] = status
        if step == len(self.lifecycle) - 1 and batch["output_file_id"] is None:
            self._finish(batch)
        return batch

    def _finish(self, batch: dict[str, Any]) -> None:
        outputs, errors = [], []
        for line in self.contents[batch["input_file_id"]].splitlines():
            custom_id = json.loads(line)["custom_id"]
            if custom_id in self.fail_custom_ids:
                error = {"code": "context_length_exceeded", "message": "too long"}
                errors.append({"custom_id": custom_id, "response": None, "error": error})
            else:
                body = {"object": batch["endpoint"], "choices": [{"text": f"answer {custom_id}"}]}
                response = {"status_code": 200, "body": body}
                outputs.append({"custom_id": custom_id, "response": response, "error": None})
        batch["output_file_id"] = self._add_file("out.jsonl", jsonl(outputs), "batch_output")["id"]
        if errors:
            error_file = self._add_file("err.jsonl", jsonl(errors), "batch_output")
            batch["error_file_id"] = error_file["id"]
        if batch["status"] == "failed":
            batch["errors"] = {"data": [{"code": "batch_failed", "message": "worker crashed"}]}


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def client_for(sleeps: Sleeps) -> Iterator[Callable[..., BatchGenHttpClient]]:
    """Builds sync clients on a MockTransport handler, recording sleeps; closes them after."""
    clients: list[BatchGenHttpClient] = []

    def make(handler: Callable[[httpx.Request], httpx.Response], **kw: Any) -> BatchGenHttpClient:
        kw.setdefault("retry", sleeps.policy())
        client = BatchGenHttpClient(BASE, transport=httpx.MockTransport(handler), **kw)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def async_client(handler: Callable[[httpx.Request], httpx.Response], sleeps: Sleeps) -> AsyncBatchGenClient:
    return AsyncBatchGenClient(BASE, transport=httpx.MockTransport(handler), retry=sleeps.policy())


# --- public surface -----------------------------------------------------------------------------


def test_public_api_is_pinned() -> None:
    assert sorted(batchgen.client.__all__) == sorted(
        [
            "APIConnectionError",
            "APIStatusError",
            "APITimeoutError",
            "AsyncBatchGenClient",
            "BatchFailed",
            "BatchGenClientError",
            "BatchGenHttpClient",
            "BatchWaitTimeout",
            "DEFAULT_BASE_URL",
            "RetriesExhausted",
            "RetryPolicy",
            "TERMINAL_STATUSES",
        ]
    )
    for name in batchgen.client.__all__:
        assert hasattr(batchgen.client, name)


def test_guide_import_path_and_namespace_package() -> None:
    assert batchgen.batchgen_client.BatchGenHttpClient is BatchGenHttpClient
    assert batchgen.batchgen_client.AsyncBatchGenClient is AsyncBatchGenClient
    assert getattr(batchgen, "__file__", None) is None  # PEP 420: no batchgen/__init__.py


def test_importing_the_client_is_light() -> None:
    """Neither the server, the core, torch nor sglang is imported, by the package or its command."""
    code = (
        "import json, sys\n"
        "import batchgen.client, batchgen.batchgen_client, batchgen.client.cli\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = json.loads(result.stdout)
    assert "batchgen.client" in modules and "httpx" in modules
    heavy = ("batchgen.core", "batchgen.server", "torch", "sglang", "litestar", "msgspec")
    assert [m for m in modules if m.split(".")[0] in heavy or m.startswith(heavy)] == []


def test_exception_tree() -> None:
    assert issubclass(BatchGenClientError, RuntimeError)
    assert issubclass(RetriesExhausted, APIStatusError)
    assert issubclass(APITimeoutError, APIConnectionError)
    assert issubclass(APITimeoutError, TimeoutError)
    assert issubclass(BatchWaitTimeout, TimeoutError)
    for exc in (APIStatusError, APIConnectionError, BatchFailed, BatchWaitTimeout):
        assert issubclass(exc, BatchGenClientError)


# --- URLs, headers, parameters ------------------------------------------------------------------


def test_default_base_url_is_localhost_10900() -> None:
    script = Script((200, {"status": "healthy"}))
    with BatchGenHttpClient(transport=httpx.MockTransport(script)) as client:
        assert client.health() == {"status": "healthy"}
    assert str(script.requests[0].url) == "http://localhost:10900/health"


@pytest.mark.parametrize("base_url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"])
def test_base_url_with_or_without_v1(base_url: str) -> None:
    script = Script((200, {"data": []}))
    with BatchGenHttpClient(base_url, transport=httpx.MockTransport(script)) as client:
        client.list_models()
        client.pool_status()
    assert [str(r.url) for r in script.requests] == [
        "http://h:1/v1/models",
        "http://h:1/v1/pool/status",
    ]


def test_base_url_with_a_path_prefix() -> None:
    script = Script((200, {"status": "healthy"}))
    with BatchGenHttpClient("http://h/batchgen", transport=httpx.MockTransport(script)) as client:
        client.health()
    assert str(script.requests[0].url) == "http://h/batchgen/health"


def test_user_agent_and_api_key(client_for: Callable[..., BatchGenHttpClient]) -> None:
    script = Script((200, {"object": "list", "data": []}))
    client_for(script, api_key="sk-test").list_batches()
    request = script.requests[0]
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.headers["user-agent"].startswith("batchgen-client/")


def test_no_authorization_header_without_api_key(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    script = Script((200, {"object": "list", "data": []}))
    client_for(script).list_batches()
    assert "authorization" not in script.requests[0].headers


def test_each_method_hits_its_route(client_for: Callable[..., BatchGenHttpClient]) -> None:
    script = Script((200, {"id": "x"}))
    client = client_for(script)
    client.list_files(after="file-1", limit=2, order="asc", purpose="batch")
    client.list_files()
    client.get_file("file-1")
    client.delete_file("file-1")
    client.get_batch("batch_1")
    client.list_batches(after="batch_0", limit=10)
    client.cancel_batch("batch_1")
    client.pool_status()
    client.list_models()
    client.health()
    assert [(r.method, str(r.url)) for r in script.requests] == [
        ("GET", f"{BASE}/v1/files?after=file-1&limit=2&order=asc&purpose=batch"),
        ("GET", f"{BASE}/v1/files"),
        ("GET", f"{BASE}/v1/files/file-1"),
        ("DELETE", f"{BASE}/v1/files/file-1"),
        ("GET", f"{BASE}/v1/batches/batch_1"),
        ("GET", f"{BASE}/v1/batches?after=batch_0&limit=10"),
        ("POST", f"{BASE}/v1/batches/batch_1/cancel"),
        ("GET", f"{BASE}/v1/pool/status"),
        ("GET", f"{BASE}/v1/models"),
        ("GET", f"{BASE}/health"),
    ]


def test_ids_are_escaped_into_one_path_segment(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    script = Script((200, {"id": "x"}))
    client_for(script).get_batch("../files/x?y")
    assert script.requests[0].url.raw_path == b"/v1/batches/..%2Ffiles%2Fx%3Fy"


def test_empty_id_is_rejected_before_sending(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    script = Script((200, {}))
    with pytest.raises(ValueError):
        client_for(script).get_file("")
    assert script.requests == []


def test_create_batch_body_omits_unset_fields(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    script = Script((200, {"id": "batch_1", "status": "validating"}))
    client = client_for(script)
    batch = client.create_batch("file-1", max_decoding_length=4096, temperature=0.0)
    client.create_batch(
        "file-2",
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"team": "a"},
        top_p=0.9,
        top_k=40,
    )
    assert batch == {"id": "batch_1", "status": "validating"}
    assert [json.loads(r.content) for r in script.requests] == [
        {
            "input_file_id": "file-1",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "max_decoding_length": 4096,
            "temperature": 0.0,
        },
        {
            "input_file_id": "file-2",
            "endpoint": "/v1/completions",
            "completion_window": "24h",
            "metadata": {"team": "a"},
            "top_p": 0.9,
            "top_k": 40,
        },
    ]
    assert all(r.headers["content-type"] == "application/json" for r in script.requests)


# --- retries ------------------------------------------------------------------------------------


def test_429_is_retried_with_the_backoff_schedule(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = Script(*[(429, FULL)] * 5, (200, {"intake_pool_size": 0}))
    assert client_for(script).pool_status() == {"intake_pool_size": 0}
    assert sleeps == [1, 2, 4, 8, 16]
    assert len(script.requests) == 6


def test_retries_exhausted_after_five_retries(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = Script((429, FULL))
    with pytest.raises(RetriesExhausted) as info:
        client_for(script).create_batch("file-1")
    exc = info.value
    assert isinstance(exc, RuntimeError)
    assert isinstance(exc, APIStatusError)
    assert exc.status_code == 429
    assert exc.attempts == 6
    assert exc.code == "capacity_exceeded"
    assert "429" in str(exc) and "6 attempts" in str(exc) and "Intake pool is full" in str(exc)
    assert len(script.requests) == 6
    assert sleeps == [1, 2, 4, 8, 16]


def test_503_is_retried(client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps) -> None:
    script = Script((503, UNAVAILABLE), (503, UNAVAILABLE), (200, {"id": "batch_1"}))
    assert client_for(script).get_batch("batch_1") == {"id": "batch_1"}
    assert sleeps == [1, 2]


def test_503_exhausted_raises(client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps) -> None:
    script = Script((503, UNAVAILABLE))
    with pytest.raises(RetriesExhausted) as info:
        client_for(script, retry=sleeps.policy(max_retries=2)).list_models()
    assert info.value.status_code == 503
    assert info.value.attempts == 3
    assert sleeps == [1, 2]


def test_retry_after_seconds_replaces_backoff(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = Script(
        (429, FULL, {"Retry-After": "30"}),
        (503, UNAVAILABLE),
        (503, UNAVAILABLE, {"Retry-After": "5"}),
        (200, {"id": "batch_1"}),
    )
    client_for(script).create_batch("file-1")
    assert sleeps == [30, 2, 5]


def test_retry_after_http_date_replaces_backoff(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    when = datetime.now(UTC) + timedelta(seconds=40)
    date = when.strftime("%a, %d %b %Y %H:%M:%S GMT")
    script = Script((429, FULL, {"Retry-After": date}), (200, {"id": "batch_1"}))
    client_for(script).get_batch("batch_1")
    assert len(sleeps) == 1
    assert 37 <= sleeps[0] <= 40


@pytest.mark.parametrize("status", [400, 404, 409, 413, 500])
def test_other_errors_are_raised_at_once(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps, status: int
) -> None:
    script = Script((status, error_body("Duplicate active batch for file-1", "duplicate_batch")))
    with pytest.raises(APIStatusError) as info:
        client_for(script).create_batch("file-1")
    exc = info.value
    assert not isinstance(exc, RetriesExhausted)
    assert exc.status_code == status
    assert exc.message == "Duplicate active batch for file-1"
    assert exc.error_type == "invalid_request_error"
    assert exc.param == "input_file_id"
    assert exc.code == "duplicate_batch"
    assert exc.body == error_body("Duplicate active batch for file-1", "duplicate_batch")
    assert f"POST /v1/batches returned HTTP {status}" in str(exc)
    assert len(script.requests) == 1
    assert sleeps == []


def test_error_without_openai_body(client_for: Callable[..., BatchGenHttpClient]) -> None:
    script = Script((500, b"Internal Server Error"))
    with pytest.raises(APIStatusError) as info:
        client_for(script).pool_status()
    assert info.value.body == "Internal Server Error"
    assert info.value.code is None
    assert "Internal Server Error" in str(info.value)


def test_success_that_is_not_a_json_object(client_for: Callable[..., BatchGenHttpClient]) -> None:
    with pytest.raises(BatchGenClientError, match="expected a JSON object"):
        client_for(Script((200, [1, 2]))).pool_status()
    with pytest.raises(BatchGenClientError, match="not JSON"):
        client_for(Script((200, b"<html>"))).pool_status()


def test_each_retry_is_logged(
    client_for: Callable[..., BatchGenHttpClient], caplog: pytest.LogCaptureFixture
) -> None:
    script = Script((429, FULL), (503, UNAVAILABLE), (200, {}))
    with caplog.at_level(logging.INFO, logger="batchgen.client"):
        client_for(script).pool_status()
    messages = [r.getMessage() for r in caplog.records if r.name == "batchgen.client"]
    assert messages == [
        "GET /v1/pool/status returned HTTP 429; retry 1 of 5 in 1.0 s",
        "GET /v1/pool/status returned HTTP 503; retry 2 of 5 in 2.0 s",
    ]


def test_create_batch_sends_one_idempotency_key_across_retries(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    script = Script((429, FULL), (503, UNAVAILABLE), (429, FULL), (200, {"id": "batch_1"}))
    client = client_for(script)
    client.create_batch("file-1")
    keys = [r.headers["idempotency-key"] for r in script.requests]
    assert len(keys) == 4
    assert len(set(keys)) == 1
    assert uuid.UUID(keys[0]).version == 4
    client.create_batch("file-1")
    assert script.requests[-1].headers["idempotency-key"] != keys[0]


def test_upload_streams_the_file_as_multipart(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    path = requests_file(tmp_path)
    script = Script((200, {"id": "file-1", "object": "file"}))
    assert client_for(script).upload_file(path) == {"id": "file-1", "object": "file"}
    fields = multipart_fields(script.requests[0])
    assert fields["file"] == ("input.jsonl", path.read_bytes())
    assert fields["purpose"] == (None, b"batch")


def test_retried_upload_sends_the_whole_file_again(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps, tmp_path: Path
) -> None:
    path = requests_file(tmp_path, n=2000)  # several of httpx's 64 KiB multipart chunks
    assert path.stat().st_size > 3 * 64 * 1024
    script = Script((503, UNAVAILABLE), (429, FULL), (200, {"id": "file-1"}))
    client_for(script).upload_file(str(path), purpose="batch")
    assert len(script.requests) == 3
    for request in script.requests:
        assert multipart_fields(request)["file"] == ("input.jsonl", path.read_bytes())
        assert int(request.headers["content-length"]) == len(request.content)
    assert sleeps == [1, 2]


def test_upload_of_a_missing_file_sends_nothing(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    script = Script((200, {}))
    with pytest.raises(FileNotFoundError):
        client_for(script).upload_file(tmp_path / "missing.jsonl")
    assert script.requests == []


# --- transport errors ---------------------------------------------------------------------------


def raising(exc: Exception) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


def test_connection_error_is_translated(client_for: Callable[..., BatchGenHttpClient]) -> None:
    cause = httpx.ConnectError("connection refused")
    with pytest.raises(APIConnectionError) as info:
        client_for(raising(cause)).health()
    assert not isinstance(info.value, TimeoutError)
    assert info.value.__cause__ is cause
    assert "GET /health" in str(info.value)


def test_timeout_is_translated(client_for: Callable[..., BatchGenHttpClient]) -> None:
    with pytest.raises(APITimeoutError) as info:
        client_for(raising(httpx.ReadTimeout("slow"))).get_batch("batch_1")
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, RuntimeError)


class FailingThen(Script):
    """Raises each of `failures` in turn (the request got no response), then answers `reply`."""

    def __init__(self, failures: list[Exception], reply: Reply) -> None:
        super().__init__(reply)
        self.failures = list(failures)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.failures:
            self.requests.append(request)
            raise self.failures.pop(0)
        return super().__call__(request)


def test_connection_errors_and_timeouts_are_retried_with_jitter(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    failures: list[Exception] = [
        httpx.ConnectError("connection refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("server disconnected without sending a response"),
    ]
    script = FailingThen(failures, (200, {"intake_pool_size": 0}))
    assert client_for(script).pool_status() == {"intake_pool_size": 0}
    assert len(script.requests) == 4
    assert len(sleeps) == 3
    for wait, base in zip(sleeps, [1, 2, 4], strict=True):
        assert base <= wait <= base * 1.5  # the schedule plus up to 50 % jitter


def test_connection_retries_exhausted(client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps) -> None:
    script = FailingThen([httpx.ConnectTimeout("no answer")] * 6, (200, {}))
    with pytest.raises(APITimeoutError) as info:
        client_for(script).get_batch("batch_1")
    assert isinstance(info.value, RuntimeError)
    assert info.value.attempts == 6
    assert "GET /v1/batches/batch_1 timed out after 6 attempts" in str(info.value)
    assert isinstance(info.value.__cause__, httpx.ConnectTimeout)
    assert len(script.requests) == 6 and len(sleeps) == 5


def test_connection_retries_can_be_turned_off(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = FailingThen([httpx.ConnectError("refused")], (200, {}))
    client = client_for(script, retry=sleeps.policy(retry_connection_errors=False))
    with pytest.raises(APIConnectionError) as info:
        client.pool_status()
    assert info.value.attempts == 1
    assert len(script.requests) == 1 and sleeps == []


def test_transport_errors_that_retrying_cannot_fix_are_raised_at_once(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = FailingThen([httpx.UnsupportedProtocol("ftp://")], (200, {}))
    with pytest.raises(APIConnectionError):
        client_for(script).pool_status()
    assert len(script.requests) == 1 and sleeps == []


def test_connection_retries_are_logged(
    client_for: Callable[..., BatchGenHttpClient], caplog: pytest.LogCaptureFixture
) -> None:
    script = FailingThen([httpx.ConnectError("refused")], (200, {}))
    with caplog.at_level(logging.INFO, logger="batchgen.client"):
        client_for(script).pool_status()
    [message] = [r.getMessage() for r in caplog.records if r.name == "batchgen.client"]
    assert message.startswith("GET /v1/pool/status failed (ConnectError('refused')); retry 1 of 5 in 1.")


def test_every_request_is_logged_at_debug(
    client_for: Callable[..., BatchGenHttpClient], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="batchgen.client"):
        client_for(Script((429, FULL), (200, {}))).pool_status()
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert debug == ["GET /v1/pool/status -> HTTP 429", "GET /v1/pool/status -> HTTP 200"]


def test_upload_and_create_retried_after_lost_responses_make_one_of_each(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    """The server acts on the first attempt but its answer is lost (a read timeout): the retry
    carries the same Idempotency-Key, so the server hands back what it made the first time."""
    server = FakeServer()
    lost: set[str] = set()

    def handler(request: httpx.Request) -> httpx.Response:
        response = server(request)
        if request.method == "POST" and request.url.path not in lost:
            lost.add(request.url.path)
            raise httpx.ReadTimeout("the response was lost", request=request)
        return response

    client = client_for(handler)
    file_obj = client.upload_file(requests_file(tmp_path))
    batch = client.create_batch(file_obj["id"])
    assert list(server.files) == [file_obj["id"]]
    assert list(server.batches) == [batch["id"]]
    for path in ("/v1/files", "/v1/batches"):
        attempts = [r for r in server.requests if r.url.path == path]
        assert len(attempts) == 2
        assert len({r.headers["idempotency-key"] for r in attempts}) == 1


def test_a_given_idempotency_key_is_sent(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    script = Script((200, {"id": "x"}))
    client = client_for(script)
    client.upload_file(requests_file(tmp_path), idempotency_key="upload-1")
    client.create_batch("file-1", idempotency_key="create-1")
    assert [r.headers["idempotency-key"] for r in script.requests] == ["upload-1", "create-1"]


# --- downloads ----------------------------------------------------------------------------------


def test_download_file_content(client_for: Callable[..., BatchGenHttpClient]) -> None:
    script = Script((503, UNAVAILABLE), (200, b'{"custom_id": "a"}\n'))
    assert client_for(script).download_file_content("file-9") == b'{"custom_id": "a"}\n'
    assert script.requests[-1].url.path == "/v1/files/file-9/content"


def test_download_file_to_streams_to_disk(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps, tmp_path: Path
) -> None:
    content = b"".join(b'{"custom_id": "r%d"}\n' % i for i in range(50_000))
    script = Script((429, FULL), (200, content))
    target = tmp_path / "out.jsonl"
    assert client_for(script).download_file_to("file-9", target) == target
    assert target.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    assert sleeps == [1]


def test_failed_download_leaves_nothing_behind(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    script = Script((404, error_body("No such file", "not_found")))
    with pytest.raises(APIStatusError) as info:
        client_for(script).download_file_to("file-9", tmp_path / "out.jsonl")
    assert info.value.status_code == 404
    assert info.value.message == "No such file"
    assert list(tmp_path.iterdir()) == []


def test_download_broken_mid_stream_leaves_nothing_behind(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    class Broken(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b'{"custom_id": "a"}\n'
            raise httpx.ReadError("connection reset")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Broken())

    target = tmp_path / "out.jsonl"
    target.write_bytes(b"previous download\n")
    with pytest.raises(APIConnectionError):
        client_for(handler).download_file_to("file-9", target)
    assert target.read_bytes() == b"previous download\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


# --- waiting ------------------------------------------------------------------------------------


def batch_script(*statuses: str, **final: Any) -> Script:
    replies: list[Reply] = [(200, {"id": "batch_1", "status": s}) for s in statuses[:-1]]
    replies.append((200, {"id": "batch_1", "status": statuses[-1], **final}))
    return Script(*replies)


def test_wait_for_batch_polls_until_completed(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = batch_script("validating", "in_progress", "in_progress", "completed", output_file_id="file-out")
    batch = client_for(script).wait_for_batch("batch_1", poll_interval=2.5)
    assert batch == {"id": "batch_1", "status": "completed", "output_file_id": "file-out"}
    assert sleeps == [2.5, 2.5, 2.5]
    assert len(script.requests) == 4


@pytest.mark.parametrize("status", ["failed", "expired", "cancelled"])
def test_wait_for_batch_returns_a_failed_batch_by_default(
    client_for: Callable[..., BatchGenHttpClient], status: str
) -> None:
    batch = client_for(batch_script("in_progress", status)).wait_for_batch("batch_1", 1.0)
    assert batch["status"] == status


def test_wait_for_batch_can_raise_on_failure(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    errors = {"data": [{"code": "capacity_exceeded", "message": "intake pool full"}]}
    script = batch_script("validating", "failed", errors=errors)
    with pytest.raises(BatchFailed) as info:
        client_for(script).wait_for_batch("batch_1", 1.0, raise_on_failure=True)
    assert info.value.status == "failed"
    assert info.value.batch["errors"] == errors
    assert str(info.value) == "batch batch_1 ended failed: capacity_exceeded: intake pool full"


def test_batch_failed_says_the_servers_failure_once() -> None:
    """The server reports a failure both in OpenAI's `errors.data` and in its own `error`."""
    error = {"code": "batch_failed", "message": "The input file is gone."}
    batch = {
        "id": "batch_1",
        "status": "failed",
        "errors": {"object": "list", "data": [error | {"param": None, "line": None}]},
        "error": error,
    }
    assert str(BatchFailed(batch)) == "batch batch_1 ended failed: batch_failed: The input file is gone."
    batch["error"] = {"code": "other", "message": "a second failure"}
    assert str(BatchFailed(batch)).endswith(": The input file is gone.; other: a second failure")


def test_wait_for_batch_raise_on_failure_returns_completed(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    script = batch_script("completed")
    assert client_for(script).wait_for_batch("batch_1", raise_on_failure=True)["status"] == ("completed")


def test_wait_for_batch_times_out(client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps) -> None:
    script = batch_script("in_progress")
    with pytest.raises(BatchWaitTimeout) as info:
        client_for(script).wait_for_batch("batch_1", poll_interval=5, timeout=0)
    assert isinstance(info.value, TimeoutError)
    assert info.value.batch == {"id": "batch_1", "status": "in_progress"}
    assert len(script.requests) == 1
    assert sleeps == []


def test_wait_for_batch_never_sleeps_past_its_timeout(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = batch_script("in_progress", "completed")
    client_for(script).wait_for_batch("batch_1", poll_interval=30, timeout=3)
    assert len(sleeps) == 1
    assert 0 < sleeps[0] <= 3


def test_wait_for_batch_rejects_a_negative_interval(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    with pytest.raises(ValueError):
        client_for(batch_script("completed")).wait_for_batch("batch_1", poll_interval=-1)


def test_health_returns_the_unhealthy_body_without_retrying(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps
) -> None:
    script = Script((503, {"status": "unhealthy", "reason": "worker down"}))
    assert client_for(script).health() == {"status": "unhealthy", "reason": "worker down"}
    assert len(script.requests) == 1
    assert sleeps == []


# --- progress -----------------------------------------------------------------------------------


def counted_script(*steps: tuple[str, int, int]) -> Script:
    """Polls of batch_1 going through (status, completed, failed) of 4 requests."""
    replies: list[Reply] = []
    for status, completed, failed in steps:
        counts = {"total": 4, "completed": completed, "failed": failed}
        replies.append((200, {"id": "batch_1", "status": status, "request_counts": counts}))
    return Script(*replies)


STEPS = (("validating", 0, 0), ("in_progress", 1, 0), ("in_progress", 2, 1), ("completed", 3, 1))


def test_on_progress_gets_every_polled_batch(client_for: Callable[..., BatchGenHttpClient]) -> None:
    seen: list[dict[str, Any]] = []
    client_for(counted_script(*STEPS)).wait_for_batch("batch_1", 1.0, on_progress=seen.append)
    assert [(b["status"], b["request_counts"]["completed"]) for b in seen] == [
        ("validating", 0),
        ("in_progress", 1),
        ("in_progress", 2),
        ("completed", 3),
    ]


def test_progress_is_off_by_default_when_stderr_is_not_a_terminal(
    client_for: Callable[..., BatchGenHttpClient], capsys: pytest.CaptureFixture[str]
) -> None:
    client_for(counted_script(*STEPS)).wait_for_batch("batch_1", 1.0)
    assert capsys.readouterr().err == ""


def test_progress_when_asked_prints_a_line_per_change(
    client_for: Callable[..., BatchGenHttpClient], capsys: pytest.CaptureFixture[str]
) -> None:
    steps = (STEPS[0], STEPS[1], STEPS[1], STEPS[2], STEPS[3])  # one poll with no change
    client_for(counted_script(*steps)).wait_for_batch("batch_1", 1.0, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["validating", "in_progress", "in_progress", "completed"]
    assert "3/4 done, 1 failed" in lines[2]
    assert "4/4 done, 1 failed" in lines[3] and " in " in lines[3]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_redrawn_in_place(
    client_for: Callable[..., BatchGenHttpClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    client_for(counted_script(*STEPS)).wait_for_batch("batch_1", 1.0)  # progress=None: on
    text = terminal.getvalue()
    assert text.count("\r") == 4 and text.count("\x1b[K") == 4
    assert text.endswith("\n") and text.count("\n") == 1  # ended once, when the wait ended
    assert "completed" in text.rsplit("\r", 1)[1]


def test_progress_line_is_ended_when_the_wait_fails(
    client_for: Callable[..., BatchGenHttpClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    script = Script(counted_script(*STEPS).replies[1], (404, error_body("No batch", "not_found")))
    with pytest.raises(APIStatusError):
        client_for(script).wait_for_batch("batch_1", 1.0)
    assert terminal.getvalue().endswith("\n")


def test_submit_batch_passes_progress_on(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[str] = []
    client_for(FakeServer()).submit_batch(
        requests_file(tmp_path),
        poll_interval=1,
        progress=True,
        on_progress=lambda b: seen.append(b["status"]),
    )
    assert seen == ["validating", "in_progress", "completed"]
    assert len(capsys.readouterr().err.splitlines()) == 3


# --- following results ---------------------------------------------------------------------------


class GrowingFile:
    """batch_1 and its output (and error) file, which grow by a piece on every poll.

    `ranges` says whether content requests honour `Range` (206, or 416 past the end); when not,
    the whole file is sent each time.
    """

    def __init__(self, pieces: list[bytes], *, ranges: bool, errors: bytes = b"") -> None:
        self.pieces = pieces
        self.ranges = ranges
        self.errors = errors
        self.polls = 0
        self.range_headers: list[str | None] = []

    def output(self) -> bytes:
        return b"".join(self.pieces[: self.polls])

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/batches/batch_1":
            self.polls += 1
            ended = self.polls >= len(self.pieces)
            batch = {"id": "batch_1", "status": "completed" if ended else "in_progress"}
            batch["output_file_id"] = "file-out"
            if self.errors:
                batch["error_file_id"] = "file-err"
            return httpx.Response(200, json=batch)
        content = self.output() if path == "/v1/files/file-out/content" else self.errors
        header = request.headers.get("range")
        self.range_headers.append(header)
        if not (self.ranges and header):
            return httpx.Response(200, content=content)
        start = int(header.removeprefix("bytes=").removesuffix("-"))
        if start >= len(content):
            return httpx.Response(416, json=error_body("Range not satisfiable", "range"))
        return httpx.Response(206, content=content[start:])


def result(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "error": None}).encode() + b"\n"


PIECES = [
    result("a") + result("b")[:7],  # the second line is cut in half
    result("b")[7:],
    b"",
    result("c") + result("d"),
]


@pytest.mark.parametrize("ranges", [True, False])
def test_follow_results_yields_each_complete_line_once(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps, ranges: bool
) -> None:
    server = GrowingFile(PIECES, ranges=ranges)
    lines = list(client_for(server).follow_results("batch_1", poll_interval=0.5))
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "b", "c", "d"]
    assert sleeps == [0.5, 0.5, 0.5]
    offsets = [0, len(result("a")), len(result("a") + result("b")), len(result("a") + result("b"))]
    expected = [None] + [f"bytes={n}-" for n in offsets[1:]]
    assert server.range_headers == expected  # each poll asks only for what it has not read


def test_follow_results_with_errors_and_a_last_line_without_newline(
    client_for: Callable[..., BatchGenHttpClient],
) -> None:
    server = GrowingFile([result("a"), result("b").rstrip(b"\n")], ranges=True, errors=result("e"))
    lines = list(client_for(server).follow_results("batch_1", poll_interval=0, errors=True))
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "e", "b"]


def test_follow_results_of_a_batch_without_output(client_for: Callable[..., BatchGenHttpClient]) -> None:
    errors = {"data": [{"code": "capacity_exceeded", "message": "full"}]}
    script = batch_script("validating", "failed", errors=errors)
    assert list(client_for(script).follow_results("batch_1", poll_interval=0)) == []
    assert len(script.requests) == 2


# --- submit_batch -------------------------------------------------------------------------------


def output_custom_ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]


def test_submit_batch_end_to_end(
    client_for: Callable[..., BatchGenHttpClient], sleeps: Sleeps, tmp_path: Path
) -> None:
    server = FakeServer()
    input_path = requests_file(tmp_path, n=5)
    output_path = tmp_path / "output.jsonl"
    batch = client_for(server).submit_batch(
        input_file_path=input_path,
        output_file_path=output_path,
        max_decoding_length=4096,
        poll_interval=7.0,
    )
    assert batch["status"] == "completed"
    assert server.seen_statuses == ["validating", "in_progress", "completed"]
    assert sleeps == [7.0, 7.0]
    assert server.contents["file-1"] == input_path.read_bytes()
    assert server.files["file-1"]["purpose"] == "batch"
    assert server.create_bodies == [
        {
            "input_file_id": "file-1",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "max_decoding_length": 4096,
        }
    ]
    assert output_path.read_bytes() == server.contents[batch["output_file_id"]]
    assert output_custom_ids(output_path) == [f"request-{i}" for i in range(5)]
    assert [(r.method, r.url.path) for r in server.requests] == [
        ("POST", "/v1/files"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches/batch_1"),
        ("GET", "/v1/batches/batch_1"),
        ("GET", "/v1/batches/batch_1"),
        ("GET", f"/v1/files/{batch['output_file_id']}/content"),
    ]


def test_submit_batch_picks_the_endpoint_from_the_first_line(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    server = FakeServer()
    input_path = requests_file(tmp_path, url="/v1/completions")
    batch = client_for(server).submit_batch(input_path, poll_interval=1.0)
    assert server.create_bodies[0]["endpoint"] == "/v1/completions"
    assert batch["endpoint"] == "/v1/completions"
    assert not any(r.url.path.endswith("/content") for r in server.requests)  # no output asked


def test_submit_batch_explicit_endpoint_wins(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    server = FakeServer()
    client_for(server).submit_batch(
        requests_file(tmp_path, url="/v1/completions"),
        endpoint="/v1/chat/completions",
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        metadata={"run": "1"},
    )
    assert server.create_bodies[0] == {
        "input_file_id": "file-1",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"run": "1"},
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
    }


def test_submit_batch_downloads_the_error_file(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path
) -> None:
    server = FakeServer(fail_custom_ids=frozenset({"request-1"}))
    output_path, error_path = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    client_for(server).submit_batch(
        requests_file(tmp_path), output_path, poll_interval=1, error_file_path=error_path
    )
    assert output_custom_ids(output_path) == ["request-0", "request-2"]
    assert output_custom_ids(error_path) == ["request-1"]


def test_submit_batch_failed_batch(client_for: Callable[..., BatchGenHttpClient], tmp_path: Path) -> None:
    lifecycle = ("validating", "in_progress", "failed")
    output_path = tmp_path / "out.jsonl"
    batch = client_for(FakeServer(lifecycle)).submit_batch(
        requests_file(tmp_path), output_path, poll_interval=1
    )
    assert batch["status"] == "failed"
    assert output_path.exists()  # partial results are kept
    with pytest.raises(BatchFailed, match="batch_failed: worker crashed"):
        client_for(FakeServer(lifecycle)).submit_batch(
            requests_file(tmp_path), poll_interval=1, raise_on_failure=True
        )


@pytest.mark.parametrize(
    ("content", "endpoint"),
    [
        (b"", "/v1/chat/completions"),
        (b"\n\nnot json\n", "/v1/chat/completions"),
        (b"[1]\n", "/v1/chat/completions"),
        (b'{"url": 3}\n', "/v1/chat/completions"),
        (b'\xef\xbb\xbf\n  \n{"url": "/v1/completions"}\nnot json\n', "/v1/completions"),
    ],
)
def test_endpoint_sniffing_skips_blanks_and_falls_back_to_chat(
    client_for: Callable[..., BatchGenHttpClient], tmp_path: Path, content: bytes, endpoint: str
) -> None:
    """The server, not the client, reports a bad input file; the client only picks an endpoint."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/batches":
            bodies.append(json.loads(request.content))
            return httpx.Response(400, json=error_body("Invalid JSONL", "invalid_file"))
        return httpx.Response(200, json={"id": "file-1"})

    path = tmp_path / "input.jsonl"
    path.write_bytes(content)
    with pytest.raises(APIStatusError) as info:
        client_for(handler).submit_batch(path)
    assert info.value.code == "invalid_file"
    assert [body["endpoint"] for body in bodies] == [endpoint]


def test_context_manager_closes_the_client() -> None:
    with BatchGenHttpClient(BASE, transport=httpx.MockTransport(Script((200, {})))) as client:
        assert not client.is_closed
    assert client.is_closed


# --- async client -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_retries_exhausted(sleeps: Sleeps) -> None:
    script = Script((429, FULL))
    async with async_client(script, sleeps) as client:
        with pytest.raises(RetriesExhausted) as info:
            await client.pool_status()
    assert isinstance(info.value, RuntimeError)
    assert info.value.attempts == 6
    assert sleeps == [1, 2, 4, 8, 16]
    assert len(script.requests) == 6
    assert client.is_closed


@pytest.mark.anyio
async def test_async_retry_after_and_503(sleeps: Sleeps) -> None:
    script = Script((503, UNAVAILABLE, {"Retry-After": "9"}), (503, UNAVAILABLE), (200, {}))
    async with async_client(script, sleeps) as client:
        assert await client.list_models() == {}
    assert sleeps == [9, 2]


@pytest.mark.anyio
async def test_async_create_batch_idempotency_key(sleeps: Sleeps) -> None:
    script = Script((429, FULL), (429, FULL), (200, {"id": "batch_1"}))
    async with async_client(script, sleeps) as client:
        assert await client.create_batch("file-1", max_decoding_length=8) == {"id": "batch_1"}
    keys = {r.headers["idempotency-key"] for r in script.requests}
    assert len(script.requests) == 3 and len(keys) == 1
    assert json.loads(script.requests[0].content)["max_decoding_length"] == 8


@pytest.mark.anyio
async def test_async_retried_upload_sends_the_whole_file_again(sleeps: Sleeps, tmp_path: Path) -> None:
    path = requests_file(tmp_path, n=2000)
    script = Script((503, UNAVAILABLE), (200, {"id": "file-1"}))
    async with async_client(script, sleeps) as client:
        assert await client.upload_file(path) == {"id": "file-1"}
    assert len(script.requests) == 2
    for request in script.requests:
        assert multipart_fields(request)["file"] == ("input.jsonl", path.read_bytes())


@pytest.mark.anyio
async def test_async_errors(sleeps: Sleeps) -> None:
    async with async_client(Script((404, error_body("No batch", "not_found"))), sleeps) as client:
        with pytest.raises(APIStatusError) as info:
            await client.get_batch("batch_x")
    assert info.value.status_code == 404 and info.value.code == "not_found"
    async with async_client(raising(httpx.ConnectTimeout("slow")), sleeps) as client:
        with pytest.raises(APITimeoutError):
            await client.health()


@pytest.mark.anyio
async def test_async_health_and_downloads(sleeps: Sleeps, tmp_path: Path) -> None:
    content = b'{"custom_id": "a"}\n' * 10_000
    script = Script((503, {"status": "unhealthy", "reason": "x"}))
    async with async_client(script, sleeps) as client:
        assert (await client.health())["status"] == "unhealthy"
    script = Script((503, UNAVAILABLE), (200, content))
    async with async_client(script, sleeps) as client:
        assert await client.download_file_to("file-9", tmp_path / "o.jsonl") == tmp_path / "o.jsonl"
        assert await client.download_file_content("file-9") == content
    assert (tmp_path / "o.jsonl").read_bytes() == content
    assert sleeps == [1]


@pytest.mark.anyio
async def test_async_wait_for_batch(sleeps: Sleeps) -> None:
    script = batch_script("validating", "in_progress", "cancelled")
    async with async_client(script, sleeps) as client:
        assert (await client.wait_for_batch("batch_1", poll_interval=3))["status"] == "cancelled"
    assert sleeps == [3, 3]
    errors = {"data": [{"code": "batch_failed", "message": "timed out"}]}
    async with async_client(batch_script("in_progress", "failed", errors=errors), sleeps) as client:
        with pytest.raises(BatchFailed, match="batch_failed: timed out"):
            await client.wait_for_batch("batch_1", poll_interval=1, raise_on_failure=True)
    async with async_client(batch_script("in_progress"), sleeps) as client:
        with pytest.raises(BatchWaitTimeout) as info:
            await client.wait_for_batch("batch_1", timeout=0)
    assert info.value.batch["status"] == "in_progress"
    assert sleeps == [3, 3, 1]


@pytest.mark.anyio
async def test_async_submit_batch_end_to_end(sleeps: Sleeps, tmp_path: Path) -> None:
    server = FakeServer()
    input_path = requests_file(tmp_path, url="/v1/completions", n=4)
    output_path = tmp_path / "output.jsonl"
    async with async_client(server, sleeps) as client:
        batch = await client.submit_batch(input_path, output_path, poll_interval=4, max_decoding_length=64)
    assert batch["status"] == "completed"
    assert server.seen_statuses == ["validating", "in_progress", "completed"]
    assert sleeps == [4, 4]
    assert server.create_bodies[0]["endpoint"] == "/v1/completions"
    assert server.create_bodies[0]["max_decoding_length"] == 64
    assert output_custom_ids(output_path) == [f"request-{i}" for i in range(4)]


@pytest.mark.anyio
async def test_async_connection_errors_are_retried(sleeps: Sleeps) -> None:
    script = FailingThen([httpx.ConnectError("refused"), httpx.ReadTimeout("slow")], (200, {}))
    async with async_client(script, sleeps) as client:
        assert await client.list_models() == {}
    assert len(script.requests) == 3 and 1 <= sleeps[0] <= 1.5 and 2 <= sleeps[1] <= 3
    script = FailingThen([httpx.ConnectError("refused")] * 6, (200, {}))
    async with async_client(script, sleeps) as client:
        with pytest.raises(APIConnectionError) as info:
            await client.list_models()
    assert info.value.attempts == 6


@pytest.mark.anyio
async def test_async_on_progress_may_be_a_coroutine_function(sleeps: Sleeps) -> None:
    seen: list[str] = []

    async def record(batch: dict[str, Any]) -> None:
        seen.append(batch["status"])

    async with async_client(counted_script(*STEPS), sleeps) as client:
        await client.wait_for_batch("batch_1", 1.0, on_progress=record)
    async with async_client(counted_script(*STEPS), sleeps) as client:
        await client.wait_for_batch("batch_1", 1.0, on_progress=lambda b: seen.append("sync"))
    assert seen == ["validating", "in_progress", "in_progress", "completed"] + ["sync"] * 4


@pytest.mark.anyio
@pytest.mark.parametrize("ranges", [True, False])
async def test_async_follow_results(sleeps: Sleeps, ranges: bool) -> None:
    server = GrowingFile(PIECES, ranges=ranges, errors=result("e"))
    async with async_client(server, sleeps) as client:
        lines = [line async for line in client.follow_results("batch_1", poll_interval=0.5, errors=True)]
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "e", "b", "c", "d"]
    assert sleeps == [0.5, 0.5, 0.5]
