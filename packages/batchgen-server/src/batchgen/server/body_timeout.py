"""The request-body timeout: a request whose body stops arriving is answered 408 and closed.

``BodyTimeoutMiddleware`` wraps the ASGI ``receive`` of each HTTP request: while the body is not
complete, each wait for its next piece may last at most ``body_timeout_s``. A slow upload that
keeps making progress goes on; one that stalls is cut. Once the body is complete, waits (for a
disconnect while a response streams) are not limited.
"""

from __future__ import annotations

from typing import Any

import anyio
from litestar import Request, Response
from litestar.types import ASGIApp, Receive, ReceiveMessage, Scope, Send

from batchgen.server.errors import error_response


class BodyTimeout(Exception):
    """The next piece of a request body did not arrive in time."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"no part of the request body arrived for {timeout_s:g} s")
        self.timeout_s = timeout_s


class BodyTimeoutMiddleware:
    def __init__(self, app: ASGIApp, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def receive_in_time() -> ReceiveMessage:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                with anyio.fail_after(self.body_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.body_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_in_time, send)


def handle_body_timeout(_: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, object]]:
    """408, and the connection is closed (the rest of the body may never come)."""
    return error_response(
        408,
        f"The request body stalled: {exc}. Send it again.",
        type_="invalid_request_error",
        code="request_timeout",
        headers={"Connection": "close"},
    )
