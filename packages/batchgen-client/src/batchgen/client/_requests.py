"""What the sync and async clients share and that does no network I/O: one `RequestSpec` per API
call, turning a spec into an `httpx.Request`, and reading responses, error bodies and errors.

Each spec builder named after a client method (`create_batch`, `get_batch`, …) is that method's
one definition for both faces: its parameters and docstring are the method's (see `_methods`),
and the faces only send what it returns.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from batchgen.client._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    BatchGenClientError,
    RetriesExhausted,
)
from batchgen.client._options import DEFAULT_COMPLETION_WINDOW, BatchOptions
from batchgen.client._wording import count_of

JSONObject = dict[str, Any]
"""What every API call returns: the decoded JSON object, as the server sent it."""

StrPath = str | os.PathLike[str]

DEFAULT_BASE_URL = "http://localhost:10900"
DEFAULT_ENDPOINT = "/v1/chat/completions"
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions"})
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
IDEMPOTENCY_KEY = "Idempotency-Key"
UPLOAD_CONTENT_TYPE = "application/jsonl"
RANGE_NOT_SATISFIABLE = 416

TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
"""Statuses after which a batch never changes again; `wait_for_batch` returns on these."""
FAILED_STATUSES = TERMINAL_STATUSES - {"completed"}


@dataclass(frozen=True, slots=True)
class Upload:
    """A file sent as the multipart `file` field; opened afresh for every attempt."""

    path: Path
    purpose: str


@dataclass(frozen=True, slots=True)
class PartUpload:
    """`length` bytes of a file from `offset`, sent as the multipart `data` field of a part of a
    chunked upload; read afresh for every attempt."""

    path: Path
    offset: int
    length: int

    def body(self) -> tuple[bytes, str]:
        """The multipart body (built here in one buffer: httpx sends that fastest) and its
        content type."""
        boundary = uuid.uuid4().hex
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="data"; filename="part"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        body = bytearray(head)
        with self.path.open("rb") as stream:
            stream.seek(self.offset)
            body += stream.read(self.length)
        body += tail
        return bytes(body), f"multipart/form-data; boundary={boundary}"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One API call, independent of attempts: the same spec is sent again on each retry."""

    method: str
    path: str
    params: Mapping[str, str | int] = field(default_factory=dict)
    json: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    upload: Upload | None = None
    part: PartUpload | None = None
    retry: bool = True
    """False for calls whose error status is itself the answer (`health`)."""
    accept_statuses: frozenset[int] = frozenset()
    """Statuses besides 2xx that are returned instead of raised."""

    def accepts(self, status_code: int) -> bool:
        return 200 <= status_code < 300 or status_code in self.accept_statuses

    def describe(self) -> str:
        return f"{self.method} {self.path}"


# --- base URL ---------------------------------------------------------------------------------


def normalize_base_url(base_url: str) -> str:
    """The server root. A trailing `/v1` (the OpenAI SDK's habit) is dropped: paths carry it."""
    url = base_url.rstrip("/")
    url = url.removesuffix("/v1")
    return url


# --- one spec per API call ----------------------------------------------------------------------


def upload_file(path: StrPath, purpose: str = "batch", *, idempotency_key: str | None = None) -> RequestSpec:
    """Upload a file, streamed from disk and re-read from the start on a retry. Every attempt
    sends one `Idempotency-Key` (as `create_batch` does), so a retry never stores it twice."""
    upload = Upload(Path(path), purpose)
    return RequestSpec("POST", "/v1/files", headers=_idempotency(idempotency_key), upload=upload)


def list_files(
    after: str | None = None,
    limit: int | None = None,
    order: str | None = None,
    purpose: str | None = None,
) -> RequestSpec:
    """A page of the server's files (GET /v1/files)."""
    params = _params(after=after, limit=limit, order=order, purpose=purpose)
    return RequestSpec("GET", "/v1/files", params=params)


def get_file(file_id: str) -> RequestSpec:
    """A file object (GET /v1/files/{file_id})."""
    return RequestSpec("GET", f"/v1/files/{_segment(file_id)}")


def delete_file(file_id: str) -> RequestSpec:
    """Delete a file (DELETE /v1/files/{file_id})."""
    return RequestSpec("DELETE", f"/v1/files/{_segment(file_id)}")


def download_file_content(file_id: str) -> RequestSpec:
    """A file's whole content, in memory. For large outputs prefer `download_file_to`."""
    return file_content(file_id)


def file_content(file_id: str, start: int = 0) -> RequestSpec:
    """GET a file's content; from byte `start` on, asked for with a `Range` header.

    A server that ignores `Range` answers 200 with the whole file (the caller skips `start`
    bytes); 416 (nothing at or after `start` yet) is an answer, not an error.
    """
    path = f"/v1/files/{_segment(file_id)}/content"
    if start <= 0:
        return RequestSpec("GET", path)
    return RequestSpec(
        "GET",
        path,
        headers={"Range": f"bytes={start}-"},
        accept_statuses=frozenset({RANGE_NOT_SATISFIABLE}),
    )


def create_batch(
    input_file_id: str,
    endpoint: str = DEFAULT_ENDPOINT,
    completion_window: str = DEFAULT_COMPLETION_WINDOW,
    metadata: Mapping[str, str] | None = None,
    max_decoding_length: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    output_order: str | None = None,
    *,
    idempotency_key: str | None = None,
) -> RequestSpec:
    """Create a batch. `output_order="input"` puts its result files in input-line order once it
    ends ("completion", or None for the server's default, leaves them as requests finished).
    Every attempt sends one `Idempotency-Key`: `idempotency_key`, or a
    fresh uuid4 per call, so a create retried after a lost response is not run twice."""
    options = BatchOptions(
        completion_window, metadata, max_decoding_length, temperature, top_p, top_k, output_order
    )
    return create(input_file_id, endpoint, options, idempotency_key=idempotency_key)


def create(
    input_file_id: str, endpoint: str, options: BatchOptions, *, idempotency_key: str | None = None
) -> RequestSpec:
    """POST /v1/batches. The Idempotency-Key belongs to the spec, so every retry of this call sends
    the same one: a retry after a lost response gets the object the first attempt made."""
    body = {"input_file_id": input_file_id, "endpoint": endpoint, **options.body()}
    return RequestSpec("POST", "/v1/batches", json=body, headers=_idempotency(idempotency_key))


def get_batch(batch_id: str) -> RequestSpec:
    """A batch object (GET /v1/batches/{batch_id})."""
    return RequestSpec("GET", f"/v1/batches/{_segment(batch_id)}")


def list_batches(after: str | None = None, limit: int | None = None) -> RequestSpec:
    """A page of batches, newest first (GET /v1/batches)."""
    return RequestSpec("GET", "/v1/batches", params=_params(after=after, limit=limit))


def cancel_batch(batch_id: str) -> RequestSpec:
    """Cancel a batch (POST /v1/batches/{batch_id}/cancel); returns it, `cancelling` or ended."""
    return RequestSpec("POST", f"/v1/batches/{_segment(batch_id)}/cancel")


def pool_status() -> RequestSpec:
    """The server's intake and scheduling pools (GET /v1/pool/status)."""
    return RequestSpec("GET", "/v1/pool/status")


def health() -> RequestSpec:
    """`{"status": "healthy"}`, or the 503 body `{"status": "unhealthy", ...}`; not retried."""
    return RequestSpec("GET", "/health", retry=False, accept_statuses=frozenset({503}))


def list_models() -> RequestSpec:
    """The models the server serves (GET /v1/models)."""
    return RequestSpec("GET", "/v1/models")


def _idempotency(key: str | None) -> dict[str, str]:
    return {IDEMPOTENCY_KEY: key if key is not None else str(uuid.uuid4())}


def _segment(identifier: str) -> str:
    if not identifier:
        raise ValueError("an id must be a non-empty string")
    return quote(identifier, safe="")


def _params(**values: str | int | None) -> dict[str, str | int]:
    return {name: value for name, value in values.items() if value is not None}


# --- spec -> httpx.Request ----------------------------------------------------------------------


def build_request(
    client: httpx.Client | httpx.AsyncClient, spec: RequestSpec, stack: ExitStack
) -> httpx.Request:
    """The request for one attempt. An upload's file is opened here (closed by `stack`) and
    streamed from disk by httpx, so a retry reads it again from the start."""
    files = None
    data = None
    if spec.upload is not None:
        handle = stack.enter_context(spec.upload.path.open("rb"))
        files = {"file": (spec.upload.path.name, handle, UPLOAD_CONTENT_TYPE)}
        data = {"purpose": spec.upload.purpose}
    headers = dict(spec.headers)
    content = None
    if spec.part is not None:
        content, headers["Content-Type"] = spec.part.body()
    return client.build_request(
        spec.method,
        spec.path,
        params=dict(spec.params) or None,
        json=spec.json,
        headers=headers or None,
        files=files,
        data=data,
        content=content,
    )


def transport_error(spec: RequestSpec, error: httpx.TransportError, *, attempts: int) -> APIConnectionError:
    """This package's exception for an httpx transport error (raise it `from error`)."""
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    if isinstance(error, httpx.TimeoutException):
        return APITimeoutError(f"{spec.describe()} timed out{tries}: {error!r}", attempts=attempts)
    return APIConnectionError(f"{spec.describe()} failed{tries}: {error!r}", attempts=attempts)


@contextmanager
def translate_transport_errors(spec: RequestSpec) -> Iterator[None]:
    """Re-raise httpx's transport errors as this package's, keeping the original as __cause__.

    For errors while reading a response body, which are not retried."""
    try:
        yield
    except httpx.TransportError as exc:
        raise transport_error(spec, exc, attempts=1) from exc


# --- responses ----------------------------------------------------------------------------------


def parse_object(spec: RequestSpec, response: httpx.Response) -> JSONObject:
    """The response's JSON object; anything else is a BatchGenClientError."""
    try:
        value = response.json()
    except ValueError as exc:
        raise BatchGenClientError(
            f"{spec.describe()} returned {response.status_code} with a body that is not JSON"
        ) from exc
    if not isinstance(value, dict):
        raise BatchGenClientError(
            f"{spec.describe()} returned {type(value).__name__}, expected a JSON object"
        )
    return value


def error_from_response(
    spec: RequestSpec, response: httpx.Response, *, attempts: int, exhausted: bool
) -> APIStatusError:
    """The exception for an error response (its body must already be read).

    `exhausted` says the status was retryable and the retries ran out: `RetriesExhausted`.
    """
    body = _decode_body(response)
    status = response.status_code
    detail = _error_message(body)
    if exhausted:
        tries = f"{count_of(attempts, 'attempt')} ({count_of(attempts - 1, 'retry', 'retries')})"
        message = f"{spec.describe()} returned HTTP {status} after {tries}"
        message = f"{message}: {detail}" if detail else message
        return RetriesExhausted(message, status_code=status, attempts=attempts, body=body, response=response)
    message = f"{spec.describe()} returned HTTP {status}"
    message = f"{message}: {detail}" if detail else message
    return APIStatusError(message, status_code=status, body=body, response=response)


def _decode_body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text or None


def _error_message(body: object) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("detail", "message"):  # framework-default error bodies
            if body.get(key):
                return str(body[key])
        return json.dumps(body)[:500]
    if isinstance(body, str):
        return body[:500]
    return ""
