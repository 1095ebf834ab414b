"""The one map from errors to OpenAI-shaped HTTP responses.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with the
matching status, and ``Retry-After`` on 429, 503 and 507. Controllers never build error responses.
An HTTP error of Litestar's keeps the headers it carries (``Allow`` on a 405). An unexpected error
is logged with the request's id (``request_ids``), the one its 500 carries in ``x-request-id``.

A storage fault (a full disk: 507 Insufficient Storage; an I/O error or a read-only folder: 503)
answers with its reason wherever it is raised, also from the server's own writes (an upload being
received), never as a 500.
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from batchgen.core.errors import (
    BatchGenError,
    Conflict,
    IntakeFull,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    StorageUnavailable,
)
from batchgen.core.storage.faults import storage_fault
from batchgen.server.request_ids import request_id_of

logger = logging.getLogger("batchgen.server")

_STATUS_AND_TYPE: tuple[tuple[type[BatchGenError], int, str], ...] = (
    (NotFound, 404, "invalid_request_error"),
    (InvalidRequest, 400, "invalid_request_error"),
    (PayloadTooLarge, 413, "invalid_request_error"),
    (Conflict, 409, "invalid_request_error"),
    (IntakeFull, 429, "rate_limit_error"),
    (ServiceUnavailable, 503, "server_error"),
    (StorageUnavailable, 503, "server_error"),  # 507 when the disk is full, below
)


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    code: str | None,
    param: str | None = None,
    retry_after_s: int | None = None,
    headers: dict[str, str] | None = None,
) -> Response[dict[str, object]]:
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    body: dict[str, object] = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(body, status_code=status, headers=headers)


def handle_service_error(_: Request, exc: Exception) -> Response[dict[str, object]]:
    assert isinstance(exc, BatchGenError)
    for kind, status, type_ in _STATUS_AND_TYPE:
        if isinstance(exc, kind):
            if isinstance(exc, StorageUnavailable) and exc.disk_full:
                status = 507
            return error_response(
                status,
                exc.message,
                type_=type_,
                code=exc.code,
                param=getattr(exc, "param", None),
                retry_after_s=getattr(exc, "retry_after_s", None),
            )
    return handle_unexpected_error(_, exc)


def handle_http_error(_: Request, exc: Exception) -> Response[dict[str, object]]:
    assert isinstance(exc, HTTPException)
    message = exc.detail or "HTTP error"
    extra = getattr(exc, "extra", None)
    param, code = None, None
    if exc.status_code == 400 and isinstance(extra, list) and extra:
        problems = "; ".join(
            f"{item.get('key', '?')}: {item.get('message', '')}" if isinstance(item, dict) else str(item)
            for item in extra
        )
        message = f"Invalid parameters: {problems}"
        first = extra[0]
        param = first.get("key") if isinstance(first, dict) and isinstance(first.get("key"), str) else None
        code = "invalid_request"  # a query parameter of the wrong type (limit=1.5), named by param
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    # Litestar's own headers stay: ``Allow`` on a 405 (RFC 9110 §15.5.6), any other it sets
    headers = {str(name): str(value) for name, value in (exc.headers or {}).items()}
    return error_response(exc.status_code, message, type_=type_, code=code, param=param, headers=headers)


def handle_unexpected_error(request: Request, exc: Exception) -> Response[dict[str, object]]:
    fault = storage_fault(exc, "store the data")
    if fault is not None:
        logger.warning("%s %s: %s", request.method, request.url.path, fault.message)
        return handle_service_error(request, fault)
    logger.exception("unexpected error", exc_info=exc, extra={"request_id": request_id_of(request.scope)})
    return error_response(
        500, "The server hit an internal error.", type_="server_error", code="internal_error"
    )
