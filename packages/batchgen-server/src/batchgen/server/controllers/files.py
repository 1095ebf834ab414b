"""``/v1/files``: upload (streamed to disk), list, retrieve, delete, and download content."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, HttpMethod, Request, Response, delete, post, route
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Stream

from batchgen.core.errors import InvalidRequest, PayloadTooLarge
from batchgen.core.service import BatchService
from batchgen.core.tenancy import Caller
from batchgen.server.errors import error_response
from batchgen.server.pagination import list_page
from batchgen.server.uploads import receive_upload

#: Multipart framing allowed on top of the file itself before an upload is refused unread.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")
_ASCII_DIGITS = re.compile(r"[0-9]+")
#: Digits past which a range bound is taken as "beyond any file" (Python refuses huge int strings).
_MAX_BOUND_DIGITS = 18


class RangeNotSatisfiable(ValueError):
    """A ``Range`` header none of whose bytes exist in the file (416)."""


def _bound(digits: str) -> int:
    return int(digits) if len(digits) <= _MAX_BOUND_DIGITS else 10**_MAX_BOUND_DIGITS


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The (start, stop) a single-range ``Range`` header asks of ``size`` bytes (RFC 9110 14.1.2).

    None means the whole file: no header, or one this server ignores as RFC 9110 allows (another
    unit, several ranges, a malformed one, or ``first`` after ``last``). Raises RangeNotSatisfiable
    (416) when no byte of the file is in the range: a start at or past the end, a zero-length
    suffix (``bytes=-0``), or any range of an empty file.
    """
    match = _RANGE.match(header.strip()) if header else None
    if match is None or not any(match.groups()):
        return None
    first, last = match.groups()
    if not first:  # bytes=-N: the last N bytes
        length = _bound(last)
        if length == 0 or size == 0:
            raise RangeNotSatisfiable(f"the range asks for the last {length} bytes of a {size}-byte file")
        return max(size - length, 0), size
    start = _bound(first)
    if last and _bound(last) < start:
        return None  # an invalid range-spec: the header is ignored
    if start >= size:
        raise RangeNotSatisfiable(f"range start {start} is past the end of the {size}-byte file")
    stop = size if not last else min(_bound(last) + 1, size)
    return start, stop


async def _no_bytes() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover - makes this an (empty) async generator


def expires_after_seconds(anchor: object, seconds: object) -> int | None:
    """The seconds of OpenAI's ``expires_after`` (``anchor`` ``created_at``, ``seconds`` N), None
    when neither is given: the form fields ``expires_after[anchor]`` and ``expires_after[seconds]``
    of ``POST /v1/files``, or the members of ``POST /v1/uploads``' JSON object (a number there).
    The service checks the bounds (``check_file_expiry``)."""
    if anchor is None and seconds is None:
        return None
    if anchor not in (None, "created_at"):
        raise InvalidRequest("expires_after[anchor] must be 'created_at'", param="expires_after")
    if isinstance(seconds, int) and not isinstance(seconds, bool):
        seconds = str(seconds)  # read as the form field's text is, so both take the same numbers
    digits = seconds.strip() if isinstance(seconds, str) else None
    # ASCII digits only: str.isdigit() also takes superscripts and other scripts' digits
    if digits is None or _ASCII_DIGITS.fullmatch(digits) is None:
        raise InvalidRequest(
            "expires_after[seconds] must be a whole number of seconds (ASCII digits)", param="expires_after"
        )
    return _bound(digits)  # past 18 digits: too many seconds, which the service says


class FilesController(Controller):
    path = "/v1/files"

    @post("/", status_code=200, request_max_body_size=None)
    async def upload(
        self,
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> dict[str, Any]:
        limit = service.max_upload_bytes
        declared = request.headers.get("content-length")
        if (
            declared is not None
            and _ASCII_DIGITS.fullmatch(declared)
            and _bound(declared) > limit + MULTIPART_OVERHEAD_BYTES
        ):
            raise PayloadTooLarge(f"The upload is {declared} bytes; the limit is {limit} bytes.")
        staging = service.new_upload_path()
        try:
            upload = await receive_upload(
                request.headers.get("content-type", ""), request.stream(), staging, limit
            )
            purpose = upload.fields.get("purpose")
            if not purpose:
                raise InvalidRequest("the form field 'purpose' is required", param="purpose")
            file = await service.add_file(
                staging,
                filename=upload.filename or "upload.jsonl",
                purpose=purpose,
                expires_after_s=expires_after_seconds(
                    upload.fields.get("expires_after[anchor]"), upload.fields.get("expires_after[seconds]")
                ),
                idempotency_key=request.headers.get("idempotency-key"),
                caller=caller,
            )
        finally:
            service.discard_upload(staging)
        return file.to_dict()

    @route("/", http_method=[HttpMethod.GET, HttpMethod.HEAD])
    async def list_files(
        self,
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = 10000,
        order: FromQuery[str] = "desc",
        purpose: FromQuery[str | None] = None,
    ) -> dict[str, Any]:
        files, has_more = await service.list_files(
            after=after, limit=limit, order=order, purpose=purpose, caller=caller
        )
        return list_page([file.to_dict() for file in files], has_more)

    @route("/{file_id:str}", http_method=[HttpMethod.GET, HttpMethod.HEAD])
    async def retrieve(
        self, file_id: FromPath[str], service: NamedDependency[BatchService], caller: NamedDependency[Caller]
    ) -> dict[str, Any]:
        return (await service.get_file(file_id, caller=caller)).to_dict()

    @delete("/{file_id:str}", status_code=200)
    async def delete_file(
        self, file_id: FromPath[str], service: NamedDependency[BatchService], caller: NamedDependency[Caller]
    ) -> dict[str, Any]:
        await service.delete_file(file_id, caller=caller)
        return {"id": file_id, "object": "file", "deleted": True}

    @route("/{file_id:str}/content", http_method=[HttpMethod.GET, HttpMethod.HEAD])
    async def content(
        self,
        file_id: FromPath[str],
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
    ) -> Stream | Response[dict[str, Any]]:
        """The file's bytes; a running batch's output holds the lines written so far.

        A single ``Range: bytes=…`` gets 206 with that part, so a follower can fetch only what
        is new; a range with no byte in the file gets 416. An output file with no line yet is an
        empty 200. ``HEAD`` answers the same status and headers without the bytes. The file is
        opened before the response starts, so nothing can fail once it has.
        """
        return await _content_response(file_id, request, service, caller, body=request.method != "HEAD")


async def _content_response(
    file_id: str, request: Request[Any, Any, Any], service: BatchService, caller: Caller, *, body: bool
) -> Stream | Response[dict[str, Any]]:
    content = await service.file_bytes(file_id, caller=caller)
    size = content.size
    try:
        wanted = byte_range(request.headers.get("range"), size)
    except RangeNotSatisfiable as exc:
        return error_response(
            416,
            str(exc),
            type_="invalid_request_error",
            code="range_not_satisfiable",
            headers={"Content-Range": f"bytes */{size}"},
        )
    headers = {"Accept-Ranges": "bytes"}
    if wanted is None:
        start, stop, status = 0, size, 200
    else:
        (start, stop), status = wanted, 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    headers["Content-Length"] = str(stop - start)
    chunks = _no_bytes()
    if body and stop > start:
        chunks = await content.open(start, stop)  # opened before the response starts
    return Stream(chunks, status_code=status, media_type="application/octet-stream", headers=headers)
