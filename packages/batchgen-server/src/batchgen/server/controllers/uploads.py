"""``/v1/uploads``: OpenAI's Uploads API (create, add a part, complete, cancel), for files too
large for one ``POST /v1/files``; the service's ``chunked_uploads`` does the work."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from batchgen.core.errors import InvalidRequest, PayloadTooLarge
from batchgen.core.files.chunked_uploads import MAX_NAME_CHARS, MAX_PART_BYTES
from batchgen.core.service import BatchService
from batchgen.core.tenancy import Caller
from batchgen.server.controllers.files import MULTIPART_OVERHEAD_BYTES, expires_after_seconds
from batchgen.server.json_bodies import json_object_body
from batchgen.server.uploads import receive_upload

#: The longest part id and md5 accepted in a complete call.
MAX_ID_CHARS = 64
_CREATE_FIELDS = frozenset({"bytes", "filename", "mime_type", "purpose", "expires_after"})
_COMPLETE_FIELDS = frozenset({"part_ids", "md5"})


def _string(body: dict[str, Any], name: str, limit: int = MAX_NAME_CHARS) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise InvalidRequest(f"'{name}' is required: a string of 1 to {limit} characters", param=name)
    return value


def _expires_after(value: Any) -> int | None:
    """Seconds from ``expires_after: {"anchor": "created_at", "seconds": N}`` (read as ``POST
    /v1/files`` reads its form fields): how long the file the upload makes is kept."""
    if value is None:
        return None
    if not isinstance(value, dict) or "seconds" not in value or set(value) - {"anchor", "seconds"}:
        raise InvalidRequest(
            'expires_after must be {"anchor": "created_at", "seconds": N}', param="expires_after"
        )
    return expires_after_seconds(value.get("anchor"), value["seconds"])


class UploadsController(Controller):
    path = "/v1/uploads"

    @post("/", status_code=200)
    async def create(
        self,
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> dict[str, Any]:
        """A pending upload: ``bytes`` (the whole file's size), ``filename``, ``purpose``, ``mime_type``,
        and optionally ``expires_after``, the lifetime of the file it makes."""
        body = json_object_body(await request.body(), _CREATE_FIELDS)
        size = body.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int):
            raise InvalidRequest("'bytes' is required: the file's size, a whole number", param="bytes")
        upload = await service.create_upload(
            filename=_string(body, "filename"),
            purpose=_string(body, "purpose"),
            size=size,
            mime_type=_string(body, "mime_type"),
            expires_after_s=_expires_after(body.get("expires_after")),
            caller=caller,
        )
        return upload.to_dict()

    @post("/{upload_id:str}/parts", status_code=200, request_max_body_size=None)
    async def add_part(
        self,
        upload_id: FromPath[str],
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> dict[str, Any]:
        """One part: the multipart form field ``data``, at most 64 MiB."""
        declared = request.headers.get("content-length")
        if (
            declared is not None
            and declared.isascii()
            and declared.isdigit()
            and (len(declared) > 18 or int(declared) > MAX_PART_BYTES + MULTIPART_OVERHEAD_BYTES)
        ):
            raise PayloadTooLarge(
                f"A part may hold at most {MAX_PART_BYTES} bytes; this body is {declared[:20]}."
            )
        destination = await service.new_upload_part(upload_id, caller=caller)
        try:
            with destination.open() as stream:
                await receive_upload(
                    request.headers.get("content-type", ""),
                    request.stream(),
                    stream,
                    MAX_PART_BYTES,
                    file_field="data",
                    strip_bom=False,
                )
        except BaseException:
            service.drop_upload_part(upload_id, destination)
            raise
        part = await service.add_upload_part(upload_id, destination, caller=caller)
        return part.to_dict()

    @post("/{upload_id:str}/complete", status_code=200)
    async def complete(
        self,
        upload_id: FromPath[str],
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> dict[str, Any]:
        """``part_ids`` in the file's order, and optionally the whole file's ``md5``."""
        body = json_object_body(await request.body(), _COMPLETE_FIELDS)
        part_ids = body.get("part_ids")
        max_parts = service.settings.max_upload_parts
        if (
            not isinstance(part_ids, list)
            or not 1 <= len(part_ids) <= max_parts
            or not all(isinstance(part, str) and 0 < len(part) <= MAX_ID_CHARS for part in part_ids)
        ):
            raise InvalidRequest(
                f"'part_ids' is required: a list of 1 to {max_parts} part ids (strings)", param="part_ids"
            )
        md5 = body.get("md5")
        if md5 is not None and (not isinstance(md5, str) or len(md5) > MAX_ID_CHARS):
            raise InvalidRequest("'md5' must be the file's md5 in hex", param="md5")
        upload, file = await service.complete_upload(upload_id, part_ids, md5=md5, caller=caller)
        return upload.to_dict(file)

    @post("/{upload_id:str}/cancel", status_code=200)
    async def cancel(
        self,
        upload_id: FromPath[str],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> dict[str, Any]:
        return (await service.cancel_upload(upload_id, caller=caller)).to_dict()
