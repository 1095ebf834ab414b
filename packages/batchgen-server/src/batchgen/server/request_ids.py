"""Request ids: every response carries ``x-request-id``, and the request's access log line the same id.

The id is ``req_`` and 32 random hex digits, minted by the server for each request; an
``x-request-id`` the client sent is ignored, as OpenAI does, so an id always names exactly one
request of this server. The openai SDK shows it as ``_request_id`` on what a call returns.

Whoever mints the id writes the header. Served by ``batchgen-server``, that is the connection's
protocol (``connection_limits.EdgeProtocol``), for every response it writes: the app's, uvicorn's
own (the 503 of the connection limit, a 500 after a crash) and its refusals before a request is
routed (a head too large, ambiguous framing); it also hands the id to the access log line and to
the app in ``scope["state"]``. ``RequestIds`` wraps the app and mints one for a request that
arrives without (served by another ASGI server, or in process), so the header never depends on how
the app is served.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

#: The response header naming the request.
REQUEST_ID_HEADER = b"x-request-id"
#: Where the id lies in a request's ``scope["state"]``.
STATE_KEY = "request_id"


def new_request_id() -> str:
    """A fresh id: ``req_`` and 128 random bits in hex."""
    return f"req_{secrets.token_hex(16)}"


def request_id_of(scope: Mapping[str, Any]) -> str | None:
    """The id of the request ``scope`` describes, or None before one is minted."""
    state = scope.get("state")
    request_id = state.get(STATE_KEY) if isinstance(state, dict) else None
    return request_id if isinstance(request_id, str) else None


def identify(state: dict[str, Any]) -> str:
    """Mint an id for a request and record it in its ``scope["state"]``, given as ``state``."""
    request_id = new_request_id()
    state[STATE_KEY] = request_id
    return request_id


class RequestIds:
    """ASGI wrapper giving a request that has no id yet one, and its response the header."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or request_id_of(scope) is not None:  # the protocol writes it
            await self._app(scope, receive, send)
            return
        header = (REQUEST_ID_HEADER, identify(scope.setdefault("state", {})).encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self._app(scope, receive, send_with_id)
