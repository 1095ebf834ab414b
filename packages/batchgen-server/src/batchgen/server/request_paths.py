"""Refuse a request path that is not canonical, before it is routed.

The router collapses repeated slashes and drops a trailing one, so ``//v1/files`` and
``/%2Fv1/files`` reach the same handler as ``/v1/files``. Access is decided on the route a request
reaches (``auth``), so such spellings gain nothing; they are refused anyway, so that no check,
log line or metric ever sees one path while another route answers. Refused with 404 in OpenAI's
error shape, for every caller, before the key check (so the answer tells nothing about routes):

* a path that does not start with ``/`` (``*``, an absolute URL), or one holding a control
  character or a backslash;
* an empty segment (``//``; one trailing slash is allowed) or a dot segment (``.``, ``..``);
* in the path as sent, an encoded ``/``, ``\\``, ``.`` or ``%`` (``%2F``, ``%5C``, ``%2E``,
  ``%25``, any case): spellings that decode to a different path, or decode again later.
"""

from __future__ import annotations

import json
import re

from litestar.types import ASGIApp, HTTPResponseBodyEvent, HTTPResponseStartEvent, Receive, Scope, Send

_ENCODED = re.compile(rb"%(2f|5c|2e|25)", re.IGNORECASE)
_CONTROL_OR_BACKSLASH = re.compile(r"[\x00-\x1f\x7f\\]")


def path_problem(path: str, raw_path: bytes | None = None) -> str | None:
    """Why a request's path (as decoded, and as sent) is not canonical, or None if it is."""
    if not path.startswith("/"):
        return "it does not start with '/'"
    if _CONTROL_OR_BACKSLASH.search(path):
        return "it holds a control character or a backslash"
    if raw_path is not None and _ENCODED.search(raw_path.partition(b"?")[0]):  # some clients add the query
        return "it holds an encoded '/', '\\', '.' or '%'"
    if path == "/":
        return None
    segments = path[1:].split("/")
    if segments[-1] == "":
        segments.pop()  # one trailing slash
    if "" in segments:
        return "it has an empty segment ('//')"
    if any(segment in (".", "..") for segment in segments):
        return "it has a dot segment ('.' or '..')"
    return None


class CanonicalPaths:
    """ASGI wrapper answering 404 to a request whose path is not canonical (see the module)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            raw = scope.get("raw_path")
            problem = path_problem(scope["path"], raw if isinstance(raw, bytes) else None)
            if problem is not None:
                if scope["type"] == "http":
                    await _not_found(send, problem)
                return
        await self._app(scope, receive, send)


async def _not_found(send: Send, problem: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"No route answers this path: {problem}. Send the path in its canonical form.",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        }
    ).encode()
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": 404,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    end: HTTPResponseBodyEvent = {"type": "http.response.body", "body": body, "more_body": False}
    await send(start)
    await send(end)
