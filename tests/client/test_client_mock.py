"""batchgen.client's two faces driven through httpx.MockTransport (no server): every test runs
once against `BatchGenHttpClient` and once against `AsyncBatchGenClient`.

The `client_for` fixture makes a client of the face under test (see `faces.py`); what it talks to
is scripted in `scripted_api.py`: fixed replies that check retries, headers and bodies, and small
in-memory fakes of the REST API for submit_batch and follow_results.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import logging
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

import batchgen
import batchgen.batchgen_client
import batchgen.client
from batchgen.client import (
    TERMINAL_STATUSES,
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AsyncBatchGenClient,
    BatchFailed,
    BatchGenClientError,
    BatchGenHttpClient,
    BatchWaitTimeout,
    RetriesExhausted,
)
from batchgen.client._options import BatchOptions
from batchgen.core.models import BatchStatus
from tests.client.faces import BASE, FACES, Face, MakeClient, Sleeps, client_maker
from tests.client.scripted_api import (
    FULL,
    PIECES,
    STEPS,
    UNAVAILABLE,
    FailingThen,
    FakeServer,
    GrowingFile,
    Script,
    batch_script,
    counted_script,
    error_body,
    multipart_fields,
    output_custom_ids,
    raising,
    requests_file,
    result,
)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture(params=FACES)
def face(request: pytest.FixtureRequest) -> Face:
    face: Face = request.param
    return face


@pytest.fixture
def client_for(face: Face, sleeps: Sleeps) -> Iterator[MakeClient]:
    """`client_for(handler, base_url=BASE, **kwargs)`: a client of the face under test on a
    MockTransport serving `handler`, recording its sleeps; closed after the test."""
    with client_maker(face, sleeps) as make:
        yield make


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
            "CacheSavings",
            "DEFAULT_BASE_URL",
            "RetriesExhausted",
            "RetryPolicy",
            "TERMINAL_STATUSES",
            "cache_savings",
        ]
    )
    for name in batchgen.client.__all__:
        assert hasattr(batchgen.client, name)


API_SIGNATURES = {
    "upload_file": "(self, path, purpose='batch', *, idempotency_key=None)",
    "upload_file_chunked": "(self, path, purpose='batch', *, part_size=67108864, md5=True)",
    "list_files": "(self, after=None, limit=None, order=None, purpose=None)",
    "get_file": "(self, file_id)",
    "delete_file": "(self, file_id)",
    "download_file_content": "(self, file_id)",
    "download_file_to": "(self, file_id, path)",
    "create_batch": "(self, input_file_id, endpoint='/v1/chat/completions', completion_window='24h', "
    "metadata=None, max_decoding_length=None, temperature=None, top_p=None, top_k=None, "
    "output_order=None, *, idempotency_key=None)",
    "get_batch": "(self, batch_id)",
    "list_batches": "(self, after=None, limit=None)",
    "cancel_batch": "(self, batch_id)",
    "retry_batch": "(self, batch_id, outcomes=None, *, completion_window=None, metadata=None, "
    "max_decoding_length=None, temperature=None, top_p=None, top_k=None, output_order=None, "
    "idempotency_key=None)",
    "download_merged_results": "(self, batch_id)",
    "download_merged_results_to": "(self, batch_id, path)",
    "wait_for_batch": "(self, batch_id, poll_interval=None, timeout=None, *, raise_on_failure=False, "
    "progress=None, on_progress=None)",
    "follow_results": "(self, batch_id, *, poll_interval=2.0, errors=False)",
    "submit_batch": "(self, input_file_path, output_file_path=None, endpoint=None, *, poll_interval=None, "
    "timeout=None, completion_window='24h', metadata=None, max_decoding_length=None, temperature=None, "
    "top_p=None, top_k=None, output_order=None, error_file_path=None, raise_on_failure=False, progress=None, "
    "on_progress=None, retry_failed=0, chunked_upload_threshold=268435456)",
    "pool_status": "(self)",
    "health": "(self)",
    "list_models": "(self)",
}
"""Every API method of both faces: the parameters as docs/client.md lists them (annotations aside)."""


def public_methods(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))}


def bare(signature: inspect.Signature) -> str:
    """The signature without annotations: names, kinds and defaults."""
    parameters = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=signature.empty))


def test_both_faces_have_the_pinned_methods_and_parameters() -> None:
    assert public_methods(BatchGenHttpClient) == set(API_SIGNATURES) | {"close"}
    assert public_methods(AsyncBatchGenClient) == set(API_SIGNATURES) | {"aclose"}
    for name, expected in API_SIGNATURES.items():
        sync = inspect.signature(getattr(BatchGenHttpClient, name))
        async_ = inspect.signature(getattr(AsyncBatchGenClient, name))
        assert bare(sync) == expected, name
        assert sync.parameters == async_.parameters, name  # annotations too
        assert getattr(BatchGenHttpClient, name).__doc__ == getattr(AsyncBatchGenClient, name).__doc__


def test_create_and_submit_take_the_batch_options() -> None:
    """`create_batch` (after the input file and endpoint) and `submit_batch` (by keyword) take
    the fields of `BatchOptions`, in its order, with its defaults and types."""
    options = fields(BatchOptions)
    for cls in (BatchGenHttpClient, AsyncBatchGenClient):
        create = inspect.signature(cls.create_batch).parameters
        submit = inspect.signature(cls.submit_batch).parameters
        names = [option.name for option in options]
        assert list(create) == ["self", "input_file_id", "endpoint", *names, "idempotency_key"]
        assert [name for name in submit if name in create] == ["self", "endpoint", *names]
        for option in options:
            for parameters in (create, submit):
                parameter = parameters[option.name]
                assert (parameter.default, parameter.annotation) == (option.default, option.type)
            assert submit[option.name].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_async_face_awaits_and_the_sync_face_does_not() -> None:
    for name in set(API_SIGNATURES) - {"follow_results"}:
        assert inspect.iscoroutinefunction(getattr(AsyncBatchGenClient, name)), name
        assert not inspect.iscoroutinefunction(getattr(BatchGenHttpClient, name)), name
    with BatchGenHttpClient(BASE) as client:
        assert isinstance(client.follow_results("batch_1"), Iterator)

    async def follow() -> object:
        async with AsyncBatchGenClient(BASE) as client:
            return client.follow_results("batch_1")

    assert isinstance(asyncio.run(follow()), AsyncIterator)


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


def test_default_base_url_is_localhost_10900(client_for: MakeClient) -> None:
    script = Script((200, {"status": "healthy"}))
    with client_for(script, base_url=None) as client:
        assert client.health() == {"status": "healthy"}
    assert str(script.requests[0].url) == "http://localhost:10900/health"


@pytest.mark.parametrize("base_url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"])
def test_base_url_with_or_without_v1(client_for: MakeClient, base_url: str) -> None:
    script = Script((200, {"data": []}))
    with client_for(script, base_url) as client:
        client.list_models()
        client.pool_status()
    assert [str(r.url) for r in script.requests] == [
        "http://h:1/v1/models",
        "http://h:1/v1/pool/status",
    ]


def test_base_url_with_a_path_prefix(client_for: MakeClient) -> None:
    script = Script((200, {"status": "healthy"}))
    with client_for(script, "http://h/batchgen") as client:
        client.health()
    assert str(script.requests[0].url) == "http://h/batchgen/health"


def test_user_agent_and_api_key(client_for: MakeClient) -> None:
    script = Script((200, {"object": "list", "data": []}))
    client_for(script, api_key="sk-test").list_batches()
    request = script.requests[0]
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.headers["user-agent"].startswith("batchgen-client/")


def test_no_authorization_header_without_api_key(
    client_for: MakeClient,
) -> None:
    script = Script((200, {"object": "list", "data": []}))
    client_for(script).list_batches()
    assert "authorization" not in script.requests[0].headers


def test_each_method_hits_its_route(client_for: MakeClient) -> None:
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
    client_for: MakeClient,
) -> None:
    script = Script((200, {"id": "x"}))
    client_for(script).get_batch("../files/x?y")
    assert script.requests[0].url.raw_path == b"/v1/batches/..%2Ffiles%2Fx%3Fy"


def test_empty_id_is_rejected_before_sending(
    client_for: MakeClient,
) -> None:
    script = Script((200, {}))
    with pytest.raises(ValueError):
        client_for(script).get_file("")
    assert script.requests == []


def test_create_batch_body_omits_unset_fields(
    client_for: MakeClient,
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


def test_429_is_retried_with_the_backoff_schedule(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = Script(*[(429, FULL)] * 5, (200, {"intake_pool_size": 0}))
    assert client_for(script).pool_status() == {"intake_pool_size": 0}
    assert sleeps == [1, 2, 4, 8, 16]
    assert len(script.requests) == 6


@pytest.mark.parametrize("call", [("create_batch", "file-1"), ("pool_status",)])
def test_retries_exhausted_after_five_retries(
    client_for: MakeClient, sleeps: Sleeps, call: tuple[str, ...]
) -> None:
    script = Script((429, FULL))
    method, *args = call
    with pytest.raises(RetriesExhausted) as info:
        getattr(client_for(script), method)(*args)
    exc = info.value
    assert isinstance(exc, RuntimeError)
    assert isinstance(exc, APIStatusError)
    assert exc.status_code == 429
    assert exc.attempts == 6
    assert exc.code == "capacity_exceeded"
    assert "429" in str(exc) and "6 attempts" in str(exc) and "Intake pool is full" in str(exc)
    assert len(script.requests) == 6
    assert sleeps == [1, 2, 4, 8, 16]


def test_503_is_retried(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = Script((503, UNAVAILABLE), (503, UNAVAILABLE), (200, {"id": "batch_1"}))
    assert client_for(script).get_batch("batch_1") == {"id": "batch_1"}
    assert sleeps == [1, 2]


def test_503_exhausted_raises(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = Script((503, UNAVAILABLE))
    with pytest.raises(RetriesExhausted) as info:
        client_for(script, retry=sleeps.policy(max_retries=2)).list_models()
    assert info.value.status_code == 503
    assert info.value.attempts == 3
    assert sleeps == [1, 2]


def test_retry_after_seconds_replaces_backoff(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = Script(
        (429, FULL, {"Retry-After": "30"}),
        (503, UNAVAILABLE),
        (503, UNAVAILABLE, {"Retry-After": "5"}),
        (200, {"id": "batch_1"}),
    )
    client_for(script).create_batch("file-1")
    assert sleeps == [30, 2, 5]


def test_retry_after_on_a_503_then_backoff(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = Script((503, UNAVAILABLE, {"Retry-After": "9"}), (503, UNAVAILABLE), (200, {}))
    assert client_for(script).list_models() == {}
    assert sleeps == [9, 2]


def test_503_on_upload_and_create_waits_what_retry_after_says(
    client_for: MakeClient, sleeps: Sleeps, tmp_path: Path
) -> None:
    """A server too busy to take a file or a batch answers 503 with Retry-After: the client waits
    exactly that long and sends the same request again (the whole file, the same key)."""
    server = FakeServer()
    refusals = {"/v1/files": ["7"], "/v1/batches": ["3", "0.5"]}

    def handler(request: httpx.Request) -> httpx.Response:
        waits = refusals.get(request.url.path, []) if request.method == "POST" else []
        if waits:
            server.requests.append(request)
            return httpx.Response(503, json=UNAVAILABLE, headers={"Retry-After": waits.pop(0)})
        return server(request)

    path = requests_file(tmp_path)
    batch = client_for(handler).submit_batch(path, tmp_path / "out.jsonl", poll_interval=1)
    assert batch["status"] == "completed"
    assert sleeps == [7, 3, 0.5, 1, 1]  # the three Retry-Afters, then the two polls
    assert list(server.files) == ["file-1", "file-2"] and list(server.batches) == ["batch_1"]
    for route, attempts in (("/v1/files", 2), ("/v1/batches", 3)):
        sent = [r for r in server.requests if r.method == "POST" and r.url.path == route]
        assert len(sent) == attempts
        assert len({r.headers["idempotency-key"] for r in sent}) == 1
    uploads = [r for r in server.requests if r.url.path == "/v1/files"]
    assert all(multipart_fields(r)["file"] == ("input.jsonl", path.read_bytes()) for r in uploads)


def test_retry_after_http_date_replaces_backoff(client_for: MakeClient, sleeps: Sleeps) -> None:
    when = datetime.now(UTC) + timedelta(seconds=40)
    date = when.strftime("%a, %d %b %Y %H:%M:%S GMT")
    script = Script((429, FULL, {"Retry-After": date}), (200, {"id": "batch_1"}))
    client_for(script).get_batch("batch_1")
    assert len(sleeps) == 1
    assert 37 <= sleeps[0] <= 40


@pytest.mark.parametrize("status", [400, 404, 409, 413, 500])
def test_other_errors_are_raised_at_once(client_for: MakeClient, sleeps: Sleeps, status: int) -> None:
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


def test_error_without_openai_body(client_for: MakeClient) -> None:
    script = Script((500, b"Internal Server Error"))
    with pytest.raises(APIStatusError) as info:
        client_for(script).pool_status()
    assert info.value.body == "Internal Server Error"
    assert info.value.code is None
    assert "Internal Server Error" in str(info.value)


def test_success_that_is_not_a_json_object(client_for: MakeClient) -> None:
    with pytest.raises(BatchGenClientError, match="expected a JSON object"):
        client_for(Script((200, [1, 2]))).pool_status()
    with pytest.raises(BatchGenClientError, match="not JSON"):
        client_for(Script((200, b"<html>"))).pool_status()


def test_each_retry_is_logged(client_for: MakeClient, caplog: pytest.LogCaptureFixture) -> None:
    script = Script((429, FULL), (503, UNAVAILABLE), (200, {}))
    with caplog.at_level(logging.INFO, logger="batchgen.client"):
        client_for(script).pool_status()
    messages = [r.getMessage() for r in caplog.records if r.name == "batchgen.client"]
    assert messages == [
        "GET /v1/pool/status returned HTTP 429; retry 1 of 5 in 1.0 s",
        "GET /v1/pool/status returned HTTP 503; retry 2 of 5 in 2.0 s",
    ]


def test_create_batch_sends_one_idempotency_key_across_retries(
    client_for: MakeClient,
) -> None:
    script = Script((429, FULL), (503, UNAVAILABLE), (429, FULL), (200, {"id": "batch_1"}))
    client = client_for(script)
    assert client.create_batch("file-1", max_decoding_length=8) == {"id": "batch_1"}
    assert all(json.loads(r.content)["max_decoding_length"] == 8 for r in script.requests)
    keys = [r.headers["idempotency-key"] for r in script.requests]
    assert len(keys) == 4
    assert len(set(keys)) == 1
    assert uuid.UUID(keys[0]).version == 4
    client.create_batch("file-1")
    assert script.requests[-1].headers["idempotency-key"] != keys[0]


def test_upload_streams_the_file_as_multipart(client_for: MakeClient, tmp_path: Path) -> None:
    path = requests_file(tmp_path)
    script = Script((200, {"id": "file-1", "object": "file"}))
    assert client_for(script).upload_file(path) == {"id": "file-1", "object": "file"}
    fields = multipart_fields(script.requests[0])
    assert fields["file"] == ("input.jsonl", path.read_bytes())
    assert fields["purpose"] == (None, b"batch")


def test_retried_upload_sends_the_whole_file_again(
    client_for: MakeClient, sleeps: Sleeps, tmp_path: Path
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


def test_upload_of_a_missing_file_sends_nothing(client_for: MakeClient, tmp_path: Path) -> None:
    script = Script((200, {}))
    with pytest.raises(FileNotFoundError):
        client_for(script).upload_file(tmp_path / "missing.jsonl")
    assert script.requests == []


# --- transport errors ---------------------------------------------------------------------------


def test_connection_error_is_translated(client_for: MakeClient) -> None:
    cause = httpx.ConnectError("connection refused")
    with pytest.raises(APIConnectionError) as info:
        client_for(raising(cause)).health()
    assert not isinstance(info.value, TimeoutError)
    assert info.value.__cause__ is cause
    assert "GET /health" in str(info.value)


def test_timeout_is_translated(client_for: MakeClient) -> None:
    with pytest.raises(APITimeoutError) as info:
        client_for(raising(httpx.ReadTimeout("slow"))).get_batch("batch_1")
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(APITimeoutError):
        client_for(raising(httpx.ConnectTimeout("slow"))).health()


def test_connection_errors_and_timeouts_are_retried_with_jitter(
    client_for: MakeClient, sleeps: Sleeps
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


def test_connection_retries_exhausted(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = FailingThen([httpx.ConnectTimeout("no answer")] * 6, (200, {}))
    with pytest.raises(APITimeoutError) as info:
        client_for(script).get_batch("batch_1")
    assert isinstance(info.value, RuntimeError)
    assert info.value.attempts == 6
    assert "GET /v1/batches/batch_1 timed out after 6 attempts" in str(info.value)
    assert isinstance(info.value.__cause__, httpx.ConnectTimeout)
    assert len(script.requests) == 6 and len(sleeps) == 5


def test_connection_retries_can_be_turned_off(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = FailingThen([httpx.ConnectError("refused")], (200, {}))
    client = client_for(script, retry=sleeps.policy(retry_connection_errors=False))
    with pytest.raises(APIConnectionError) as info:
        client.pool_status()
    assert info.value.attempts == 1
    assert len(script.requests) == 1 and sleeps == []


def test_transport_errors_that_retrying_cannot_fix_are_raised_at_once(
    client_for: MakeClient, sleeps: Sleeps
) -> None:
    script = FailingThen([httpx.UnsupportedProtocol("ftp://")], (200, {}))
    with pytest.raises(APIConnectionError):
        client_for(script).pool_status()
    assert len(script.requests) == 1 and sleeps == []


def test_connection_retries_are_logged(client_for: MakeClient, caplog: pytest.LogCaptureFixture) -> None:
    script = FailingThen([httpx.ConnectError("refused")], (200, {}))
    with caplog.at_level(logging.INFO, logger="batchgen.client"):
        client_for(script).pool_status()
    [message] = [r.getMessage() for r in caplog.records if r.name == "batchgen.client"]
    assert message.startswith("GET /v1/pool/status failed (ConnectError('refused')); retry 1 of 5 in 1.")


def test_every_request_is_logged_at_debug(client_for: MakeClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="batchgen.client"):
        client_for(Script((429, FULL), (200, {}))).pool_status()
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert debug == ["GET /v1/pool/status -> HTTP 429", "GET /v1/pool/status -> HTTP 200"]


def test_upload_and_create_retried_after_lost_responses_make_one_of_each(
    client_for: MakeClient, tmp_path: Path
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


def test_a_given_idempotency_key_is_sent(client_for: MakeClient, tmp_path: Path) -> None:
    script = Script((200, {"id": "x"}))
    client = client_for(script)
    client.upload_file(requests_file(tmp_path), idempotency_key="upload-1")
    client.create_batch("file-1", idempotency_key="create-1")
    assert [r.headers["idempotency-key"] for r in script.requests] == ["upload-1", "create-1"]


# --- downloads ----------------------------------------------------------------------------------


def test_download_file_content(client_for: MakeClient) -> None:
    script = Script((503, UNAVAILABLE), (200, b'{"custom_id": "a"}\n'))
    assert client_for(script).download_file_content("file-9") == b'{"custom_id": "a"}\n'
    assert script.requests[-1].url.path == "/v1/files/file-9/content"


def test_download_file_to_streams_to_disk(client_for: MakeClient, sleeps: Sleeps, tmp_path: Path) -> None:
    content = b"".join(b'{"custom_id": "r%d"}\n' % i for i in range(50_000))
    script = Script((429, FULL), (200, content))
    target = tmp_path / "out.jsonl"
    assert client_for(script).download_file_to("file-9", target) == target
    assert target.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    assert sleeps == [1]


def test_failed_download_leaves_nothing_behind(client_for: MakeClient, tmp_path: Path) -> None:
    script = Script((404, error_body("No such file", "not_found")))
    with pytest.raises(APIStatusError) as info:
        client_for(script).download_file_to("file-9", tmp_path / "out.jsonl")
    assert info.value.status_code == 404
    assert info.value.message == "No such file"
    assert list(tmp_path.iterdir()) == []


def test_download_broken_mid_stream_leaves_nothing_behind(client_for: MakeClient, tmp_path: Path) -> None:
    class Broken(httpx.SyncByteStream, httpx.AsyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b'{"custom_id": "a"}\n'
            raise httpx.ReadError("connection reset")

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for chunk in self:
                yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Broken())

    target = tmp_path / "out.jsonl"
    target.write_bytes(b"previous download\n")
    with pytest.raises(APIConnectionError):
        client_for(handler).download_file_to("file-9", target)
    assert target.read_bytes() == b"previous download\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


# --- waiting ------------------------------------------------------------------------------------


def test_wait_for_batch_polls_until_completed(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = batch_script("validating", "in_progress", "in_progress", "completed", output_file_id="file-out")
    batch = client_for(script).wait_for_batch("batch_1", poll_interval=2.5)
    assert batch == {"id": "batch_1", "status": "completed", "output_file_id": "file-out"}
    assert sleeps == [2.5, 2.5, 2.5]
    assert len(script.requests) == 4


@pytest.mark.parametrize("status", ["failed", "expired", "cancelled"])
def test_wait_for_batch_returns_a_failed_batch_by_default(client_for: MakeClient, status: str) -> None:
    batch = client_for(batch_script("in_progress", status)).wait_for_batch("batch_1", 1.0)
    assert batch["status"] == status


SERVER_TERMINAL = sorted(status.value for status in BatchStatus if status.is_terminal)
NOT_TERMINAL = [status.value for status in BatchStatus if not status.is_terminal]
GONE = (404, error_body("No such batch", "not_found"))
"""What the scripts answer once a batch has ended: a client that polls on past the end fails."""


def test_terminal_statuses_are_the_servers() -> None:
    assert frozenset(SERVER_TERMINAL) == TERMINAL_STATUSES
    assert NOT_TERMINAL == ["validating", "in_progress", "finalizing", "cancelling"]


def polled_until(server: FakeServer, polls: int) -> Callable[[httpx.Request], httpx.Response]:
    """`server`, except that batch_1 is gone after `polls` polls."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/batches/batch_1" and server.polls.get("batch_1", 0) >= polls:
            return httpx.Response(GONE[0], json=GONE[1])
        return server(request)

    return handler


@pytest.mark.parametrize("status", SERVER_TERMINAL)
def test_every_terminal_status_ends_a_wait(
    client_for: MakeClient, sleeps: Sleeps, tmp_path: Path, status: str
) -> None:
    """wait_for_batch, follow_results and submit_batch poll through every other status and stop
    at the first terminal one; raise_on_failure raises for all but completed."""
    script = Script(*[(200, {"id": "batch_1", "status": s}) for s in (*NOT_TERMINAL, status)], GONE)
    assert client_for(script).wait_for_batch("batch_1", poll_interval=1)["status"] == status
    assert len(script.requests) == 5 and sleeps == [1] * 4
    script.requests.clear()
    assert list(client_for(script).follow_results("batch_1", poll_interval=1)) == []
    assert len(script.requests) == 5

    lifecycle = (*NOT_TERMINAL, status)
    server = FakeServer(lifecycle)
    output = tmp_path / "out.jsonl"
    batch = client_for(polled_until(server, 5)).submit_batch(requests_file(tmp_path), output, poll_interval=1)
    assert batch["status"] == status and server.polls == {"batch_1": 5}
    server = FakeServer(lifecycle)
    submit = client_for(polled_until(server, 5)).submit_batch
    if status == "completed":
        assert submit(requests_file(tmp_path), poll_interval=1, raise_on_failure=True)["status"] == status
    else:
        with pytest.raises(BatchFailed) as info:
            submit(requests_file(tmp_path), poll_interval=1, raise_on_failure=True)
        assert info.value.status == status


def test_wait_for_batch_can_raise_on_failure(
    client_for: MakeClient,
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
    client_for: MakeClient,
) -> None:
    script = batch_script("completed")
    assert client_for(script).wait_for_batch("batch_1", raise_on_failure=True)["status"] == ("completed")


def test_wait_for_batch_times_out(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = batch_script("in_progress")
    with pytest.raises(BatchWaitTimeout) as info:
        client_for(script).wait_for_batch("batch_1", poll_interval=5, timeout=0)
    assert isinstance(info.value, TimeoutError)
    assert info.value.batch == {"id": "batch_1", "status": "in_progress"}
    assert len(script.requests) == 1
    assert sleeps == []


def test_polls_start_at_one_second_and_grow_to_five_by_default(
    client_for: MakeClient, sleeps: Sleeps, tmp_path: Path
) -> None:
    """Without poll_interval, a short batch is seen ending soon after it does, and a long one is
    asked about every 5 s; the docstring says so."""
    script = batch_script(*["in_progress"] * 7, "completed")
    assert client_for(script).wait_for_batch("batch_1")["status"] == "completed"
    assert sleeps == [1, 1.5, 2.25, 3.375, 5, 5, 5]
    sleeps.clear()
    client_for(FakeServer()).submit_batch(requests_file(tmp_path), tmp_path / "out.jsonl")
    assert sleeps == [1, 1.5]
    doc = BatchGenHttpClient.wait_for_batch.__doc__ or ""
    assert "(None) the first wait is 1 s, then\n    each is 1.5 times the one before, up to 5 s" in doc


def test_wait_for_batch_never_sleeps_past_its_timeout(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = batch_script("in_progress", "completed")
    client_for(script).wait_for_batch("batch_1", poll_interval=30, timeout=3)
    assert len(sleeps) == 1
    assert 0 < sleeps[0] <= 3


def test_wait_for_batch_rejects_a_negative_interval(
    client_for: MakeClient,
) -> None:
    with pytest.raises(ValueError):
        client_for(batch_script("completed")).wait_for_batch("batch_1", poll_interval=-1)


def test_health_returns_the_unhealthy_body_without_retrying(client_for: MakeClient, sleeps: Sleeps) -> None:
    script = Script((503, {"status": "unhealthy", "reason": "worker down"}))
    assert client_for(script).health() == {"status": "unhealthy", "reason": "worker down"}
    assert len(script.requests) == 1
    assert sleeps == []


# --- progress -----------------------------------------------------------------------------------


def test_on_progress_gets_every_polled_batch(client_for: MakeClient) -> None:
    seen: list[dict[str, Any]] = []
    client_for(counted_script(*STEPS)).wait_for_batch("batch_1", 1.0, on_progress=seen.append)
    assert [(b["status"], b["request_counts"]["completed"]) for b in seen] == [
        ("validating", 0),
        ("in_progress", 1),
        ("in_progress", 2),
        ("completed", 3),
    ]


def test_progress_is_off_by_default_when_stderr_is_not_a_terminal(
    client_for: MakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    client_for(counted_script(*STEPS)).wait_for_batch("batch_1", 1.0)
    assert capsys.readouterr().err == ""


def test_progress_when_asked_prints_a_line_per_change(
    client_for: MakeClient, capsys: pytest.CaptureFixture[str]
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
    client_for: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    client_for(counted_script(*STEPS)).wait_for_batch("batch_1", 1.0)  # progress=None: on
    text = terminal.getvalue()
    assert text.count("\r") == 4 and text.count("\x1b[K") == 4
    assert text.endswith("\n") and text.count("\n") == 1  # ended once, when the wait ended
    assert "completed" in text.rsplit("\r", 1)[1]


def test_progress_line_is_ended_when_the_wait_fails(
    client_for: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    script = Script(counted_script(*STEPS).replies[1], (404, error_body("No batch", "not_found")))
    with pytest.raises(APIStatusError):
        client_for(script).wait_for_batch("batch_1", 1.0)
    assert terminal.getvalue().endswith("\n")


def test_submit_batch_passes_progress_on(
    client_for: MakeClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
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


@pytest.mark.parametrize("ranges", [True, False])
def test_follow_results_yields_each_complete_line_once(
    client_for: MakeClient, sleeps: Sleeps, ranges: bool
) -> None:
    server = GrowingFile(PIECES, ranges=ranges)
    lines = list(client_for(server).follow_results("batch_1", poll_interval=0.5))
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "b", "c", "d"]
    assert sleeps == [0.5, 0.5, 0.5]
    offsets = [0, len(result("a")), len(result("a") + result("b")), len(result("a") + result("b"))]
    expected = [None] + [f"bytes={n}-" for n in offsets[1:]]
    assert server.range_headers == expected  # each poll asks only for what it has not read


def test_follow_results_with_errors_and_a_last_line_without_newline(
    client_for: MakeClient,
) -> None:
    server = GrowingFile([result("a"), result("b").rstrip(b"\n")], ranges=True, errors=result("e"))
    lines = list(client_for(server).follow_results("batch_1", poll_interval=0, errors=True))
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "e", "b"]


@pytest.mark.parametrize("ranges", [True, False])
def test_follow_results_reads_the_error_file_alongside(
    client_for: MakeClient, sleeps: Sleeps, ranges: bool
) -> None:
    server = GrowingFile(PIECES, ranges=ranges, errors=result("e"))
    lines = list(client_for(server).follow_results("batch_1", poll_interval=0.5, errors=True))
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "e", "b", "c", "d"]
    assert sleeps == [0.5, 0.5, 0.5]


def test_follow_results_of_a_batch_without_output(client_for: MakeClient) -> None:
    errors = {"data": [{"code": "capacity_exceeded", "message": "full"}]}
    script = batch_script("validating", "failed", errors=errors)
    assert list(client_for(script).follow_results("batch_1", poll_interval=0)) == []
    assert len(script.requests) == 2


# --- submit_batch -------------------------------------------------------------------------------


def test_submit_batch_end_to_end(client_for: MakeClient, sleeps: Sleeps, tmp_path: Path) -> None:
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


def test_submit_batch_picks_the_endpoint_from_the_first_line(client_for: MakeClient, tmp_path: Path) -> None:
    server = FakeServer()
    input_path = requests_file(tmp_path, url="/v1/completions")
    batch = client_for(server).submit_batch(input_path, poll_interval=1.0)
    assert server.create_bodies[0]["endpoint"] == "/v1/completions"
    assert batch["endpoint"] == "/v1/completions"
    assert not any(r.url.path.endswith("/content") for r in server.requests)  # no output asked


def test_submit_batch_explicit_endpoint_wins(client_for: MakeClient, tmp_path: Path) -> None:
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


def test_submit_batch_downloads_the_error_file(client_for: MakeClient, tmp_path: Path) -> None:
    server = FakeServer(fail_custom_ids=frozenset({"request-1"}))
    output_path, error_path = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    client_for(server).submit_batch(
        requests_file(tmp_path), output_path, poll_interval=1, error_file_path=error_path
    )
    assert output_custom_ids(output_path) == ["request-0", "request-2"]
    assert output_custom_ids(error_path) == ["request-1"]


def test_submit_batch_failed_batch(client_for: MakeClient, tmp_path: Path) -> None:
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
    client_for: MakeClient, tmp_path: Path, content: bytes, endpoint: str
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


def test_context_manager_closes_the_client(client_for: MakeClient) -> None:
    with client_for(Script((200, {}))) as client:
        assert not client.is_closed
    assert client.is_closed


# --- only the async face --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_on_progress_may_be_a_coroutine_function(sleeps: Sleeps) -> None:
    """A coroutine function as `on_progress` is awaited: a feature of the async face alone."""
    seen: list[str] = []

    async def record(batch: dict[str, Any]) -> None:
        seen.append(batch["status"])

    transport = httpx.MockTransport(counted_script(*STEPS))
    async with AsyncBatchGenClient(BASE, transport=transport, retry=sleeps.policy()) as client:
        await client.wait_for_batch("batch_1", 1.0, on_progress=record)
    transport = httpx.MockTransport(counted_script(*STEPS))
    async with AsyncBatchGenClient(BASE, transport=transport, retry=sleeps.policy()) as client:
        await client.wait_for_batch("batch_1", 1.0, on_progress=lambda b: seen.append("sync"))
    assert seen == ["validating", "in_progress", "in_progress", "completed"] + ["sync"] * 4
