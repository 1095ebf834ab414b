"""``POST /v1/batches/{id}/retry`` (a new batch over what did not succeed) and
``GET /v1/batches/{id}/merged_results`` (the best result so far of every request of a batch and
its retries, streamed from their own result files)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from litestar import Controller, HttpMethod, Request, post, route
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Stream

from batchgen.core.batches.result_merge import FamilyIndex
from batchgen.core.batches.retry import OUTCOMES, RetryRequest
from batchgen.core.errors import InvalidRequest
from batchgen.core.service import BatchService
from batchgen.core.tenancy import Caller
from batchgen.server.controllers.batches import _output_expiry_seconds
from batchgen.server.json_bodies import json_object_body

#: The largest retry body read: its fields are a few short values (metadata is the biggest).
MAX_BODY_BYTES = 64 * 1024
#: The body's fields: what to retry, then the batch-level fields (the original's when left out).
_PARAMETER_FIELDS = (
    "completion_window",
    "metadata",
    "max_decoding_length",
    "temperature",
    "top_p",
    "top_k",
    "output_order",
)
_ALLOWED_FIELDS = frozenset(("outcomes", "output_expires_after", *_PARAMETER_FIELDS))


def parse_retry_body(raw: bytes) -> RetryRequest:
    """The retry a request body asks for (an empty body: the default, every outcome); InvalidRequest
    naming the field for anything else than the documented fields with their types."""
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidRequest(f"The request body is {len(raw)} bytes; a retry body may have {MAX_BODY_BYTES}.")
    if not raw.strip():
        return RetryRequest()
    body = json_object_body(raw, _ALLOWED_FIELDS)
    outcomes = body.get("outcomes", list(OUTCOMES))
    if (
        not isinstance(outcomes, list)
        or not all(isinstance(name, str) for name in outcomes)
        or len(outcomes) > len(OUTCOMES)
    ):
        raise InvalidRequest("outcomes must be a list of 'failed' and/or 'not_run'", param="outcomes")
    overrides: dict[str, Any] = {}
    for name in _PARAMETER_FIELDS:
        if name in body:
            overrides[name] = _checked_type(name, body[name])
    if "output_expires_after" in body:
        overrides["output_expires_after_s"] = _output_expiry_seconds(body["output_expires_after"])
    return RetryRequest(frozenset(outcomes), overrides)


def _checked_type(name: str, value: Any) -> Any:
    """``value`` if it has the type field ``name`` takes (its range is the create call's to check)."""
    if value is None:
        if name == "completion_window":
            raise InvalidRequest("completion_window must be a string such as '24h'", param=name)
        return None
    if name in ("completion_window", "output_order"):
        ok = isinstance(value, str)
    elif name == "metadata":
        ok = isinstance(value, dict)
    elif name in ("max_decoding_length", "top_k"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise InvalidRequest(f"{name} has the wrong type ({type(value).__name__})", param=name)
    return float(value) if name in ("temperature", "top_p") else value


async def _merged_chunks(index: FamilyIndex) -> AsyncIterator[bytes]:
    """The merged view, each chunk read in a worker thread; the index is closed at the end."""
    chunks = index.merged_chunks()
    try:
        while True:
            chunk = await anyio.to_thread.run_sync(next, chunks, None)
            if chunk is None:
                return
            yield chunk
    finally:
        await anyio.to_thread.run_sync(chunks.close)
        index.close()


class RetriesController(Controller):
    path = "/v1/batches"

    @post("/{batch_id:str}/retry", status_code=200, request_max_body_size=MAX_BODY_BYTES)
    async def retry(
        self,
        batch_id: FromPath[str],
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> dict[str, Any]:
        """A new batch over the lines of an ended batch that did not succeed."""
        retry = parse_retry_body(await request.body())
        batch = await service.retry_batch(
            batch_id, retry, idempotency_key=request.headers.get("idempotency-key"), caller=caller
        )
        return batch.to_dict()

    @route("/{batch_id:str}/merged_results", http_method=[HttpMethod.GET, HttpMethod.HEAD])
    async def merged_results(
        self,
        batch_id: FromPath[str],
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> Stream:
        """The best result so far of every request of the batch and its retries, in input order.

        The index is built before the response starts, so every refusal is a status, not a cut
        body; ``Content-Length`` is the exact size."""
        index = await service.merged_results(batch_id, caller=caller)
        try:
            size = await anyio.to_thread.run_sync(index.merged_size)
        except BaseException:
            index.close()
            raise
        headers = {"Content-Length": str(size)}
        if request.method == "HEAD":
            index.close()
            return Stream(_no_chunks(), media_type="application/jsonl", headers=headers)
        return Stream(_merged_chunks(index), media_type="application/jsonl", headers=headers)


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover - makes this an (empty) async generator
