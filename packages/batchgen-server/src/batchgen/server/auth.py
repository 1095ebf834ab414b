"""Who is calling: the API-key check in front of ``/v1/*`` and ``/metrics``, and the ``caller``
dependency the controllers pass to the service.

While no key exists, nothing is checked and every call is made as the embedded admin caller
(the behaviour of a server without keys). Once a key exists, a request to a guarded path needs
``Authorization: Bearer <key>`` with a key that is not revoked, else it gets 401 in OpenAI's
error shape with ``WWW-Authenticate: Bearer``. Other paths (``/health``, the dashboard page at
``/``) stay open. The check wraps the whole ASGI handler, so unknown ``/v1`` paths are guarded
too, and it never logs a presented key.
"""

from __future__ import annotations

import json
from typing import Any

from litestar import Request
from litestar.types import ASGIApp, HTTPResponseBodyEvent, HTTPResponseStartEvent, Receive, Scope, Send

from batchgen.core.tenancy import EMBEDDED, Caller
from batchgen.server.api_keys import KeyStore

#: Paths (and what lies below them) that need a key once keys exist.
GUARDED_PREFIXES = ("/v1", "/metrics")
_CALLER = "batchgen.caller"


def is_guarded(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in GUARDED_PREFIXES)


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyGuard:
    """ASGI wrapper answering 401 to guarded requests without a valid key, and recording the
    caller of the others in the request's state."""

    def __init__(self, app: ASGIApp, keys: KeyStore) -> None:
        self._app = app
        self._keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_guarded(scope["path"]) and self._keys.has_keys():
            token = _bearer_token(scope)
            caller = None if token is None else self._keys.authenticate(token, refresh=False)
            if caller is None:
                await _unauthorized(send, "missing" if token is None else "invalid")
                return
            scope.setdefault("state", {})[_CALLER] = caller
        await self._app(scope, receive, send)


async def _unauthorized(send: Send, problem: str) -> None:
    message = (
        "Missing API key: send it as 'Authorization: Bearer <key>' (create one with "
        "'batchgen-server keys create --tenant NAME')."
        if problem == "missing"
        else "Invalid or revoked API key."
    )
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    ).encode()
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": 401,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="batchgen"'),
        ],
    }
    end: HTTPResponseBodyEvent = {"type": "http.response.body", "body": body, "more_body": False}
    await send(start)
    await send(end)


def provide_caller(request: Request[Any, Any, Any]) -> Caller:
    """The caller the guard recorded; the embedded admin caller when no key is needed."""
    caller = request.scope.get("state", {}).get(_CALLER)
    return caller if isinstance(caller, Caller) else EMBEDDED
