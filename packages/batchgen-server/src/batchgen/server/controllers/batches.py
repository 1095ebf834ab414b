"""``/v1/batches``: create, retrieve, list (newest first, or oldest with ``order=asc``) and cancel."""

from __future__ import annotations

from typing import Any

from litestar import Controller, HttpMethod, Request, Response, post, route
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from batchgen.core.errors import InvalidRequest
from batchgen.core.models import BatchParameters
from batchgen.core.service import BatchService
from batchgen.core.tenancy import Caller
from batchgen.server.etags import json_with_etag
from batchgen.server.json_bodies import json_object_body
from batchgen.server.pagination import list_page

#: What OpenAI's create call takes (every field the ``openai`` SDK sends), then BatchGen's
#: batch-level sampling defaults. Anything else is refused by name.
_OPENAI_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after")
_BATCHGEN_FIELDS = ("max_decoding_length", "temperature", "top_p", "top_k", "output_order")
_ALLOWED_FIELDS = frozenset(_OPENAI_FIELDS + _BATCHGEN_FIELDS)


def _output_expiry_seconds(value: Any) -> int | None:
    """Seconds from OpenAI's ``output_expires_after: {"anchor": "created_at", "seconds": N}``."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"anchor", "seconds"}:
        raise InvalidRequest(
            'output_expires_after must be {"anchor": "created_at", "seconds": N}',
            param="output_expires_after",
        )
    if value.get("anchor") != "created_at":
        raise InvalidRequest("output_expires_after.anchor must be 'created_at'", param="output_expires_after")
    seconds = value.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise InvalidRequest(
            "output_expires_after.seconds must be a whole number of seconds", param="output_expires_after"
        )
    return seconds


def _parse_create_body(raw: bytes) -> dict[str, Any]:
    body = json_object_body(raw, _ALLOWED_FIELDS)
    for required in ("input_file_id", "endpoint"):
        if not isinstance(body.get(required), str):
            raise InvalidRequest(f"'{required}' is required and must be a string", param=required)
    return body


class BatchesController(Controller):
    path = "/v1/batches"

    @post("/", status_code=200)
    async def create(
        self,
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> dict[str, Any]:
        body = _parse_create_body(await request.body())
        batch = await service.create_batch(
            body["input_file_id"],
            body["endpoint"],
            completion_window=body.get("completion_window", "24h"),
            metadata=body.get("metadata"),
            parameters=BatchParameters(
                max_decoding_length=body.get("max_decoding_length"),
                temperature=body.get("temperature"),
                top_p=body.get("top_p"),
                top_k=body.get("top_k"),
            ),
            output_expires_after_s=_output_expiry_seconds(body.get("output_expires_after")),
            output_order=body.get("output_order"),
            idempotency_key=request.headers.get("idempotency-key"),
            caller=caller,
        )
        return batch.to_dict()

    @route("/", http_method=[HttpMethod.GET, HttpMethod.HEAD])
    async def list_batches(
        self,
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = 20,
        order: FromQuery[str] = "desc",
    ) -> dict[str, Any]:
        batches, has_more = await service.list_batches(after=after, limit=limit, order=order, caller=caller)
        return list_page([batch.to_dict() for batch in batches], has_more)

    @route("/{batch_id:str}", http_method=[HttpMethod.GET, HttpMethod.HEAD])
    async def retrieve(
        self,
        request: Request[Any, Any, Any],
        batch_id: FromPath[str],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> Response[dict[str, Any]]:
        """The batch (from memory while it runs), with an ETag; 304 when If-None-Match matches."""
        return json_with_etag(request, (await service.get_batch(batch_id, caller=caller)).to_dict())

    @post("/{batch_id:str}/cancel", status_code=200)
    async def cancel(
        self, batch_id: FromPath[str], service: NamedDependency[BatchService], caller: NamedDependency[Caller]
    ) -> dict[str, Any]:
        return (await service.cancel_batch(batch_id, caller=caller)).to_dict()
