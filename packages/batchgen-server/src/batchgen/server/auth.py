"""Who may call which route, and as whom: the API-key check, decided per matched route, and the
``caller`` dependency the controllers pass to the service.

Access is denied by default. A route is open only if its handler (or a layer above it) declares
``opt={"open": True}`` (``OPEN``): ``/health``, the dashboard page and its files, the OpenAPI
pages. Every other route, whatever its method (``HEAD`` and ``OPTIONS`` included), needs a key
once a key exists: ``Authorization: Bearer <key>`` with a key that is not revoked, else 401 in
OpenAI's error shape with ``WWW-Authenticate: Bearer``. A path no route answers (404) or a method
a route does not take (405) is told only to a caller with a valid key; without one it is the same
401, so the answer says nothing about which routes exist.

The check runs after routing, on the handler the router chose, so however a path is spelt the
route it reaches is the route that is checked (``request_paths`` refuses non-canonical spellings
before routing as well). The caller is recorded in the request's scope by the check: the embedded
admin caller while no key exists, else the key's tenant. ``provide_caller`` never falls back: a
handler that asks for the caller where none was recorded gets 401. The check never logs a
presented key.
"""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.handlers import BaseRouteHandler
from litestar.routes import HTTPRoute
from litestar.types import Scope

from batchgen.core.tenancy import EMBEDDED, Caller, reserved_tenant_problem
from batchgen.server.api_keys import ApiKeys
from batchgen.server.errors import error_response, handle_http_error

#: The ``opt`` key that declares a route open (served without a key).
OPEN = "open"
#: ``opt=OPEN_ROUTE`` on a route handler, controller or router: served without a key.
OPEN_ROUTE: dict[str, Any] = {OPEN: True}
_CALLER = "batchgen.caller"

_MISSING = (
    "Missing API key: send it as 'Authorization: Bearer <key>' (create one with "
    "'batchgen-server keys create --tenant NAME')."
)
_INVALID = "Invalid or revoked API key."


class ApiKeyRefused(NotAuthorizedException):
    """401: no key, or one that is unknown, malformed or revoked."""


def is_open(handler: BaseRouteHandler) -> bool:
    """Whether a route handler is declared open (served without a key)."""
    return bool(handler.opt.get(OPEN))


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class KeyCheck:
    """The per-route check (a Litestar guard on the whole app) and the answer to unrouted requests."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    def _caller(self, scope: Scope) -> Caller:
        """The caller a request's key stands for; EMBEDDED while no key exists; else ApiKeyRefused."""
        if not self._keys.has_keys():
            return EMBEDDED
        token = _bearer_token(scope)
        if token is None:
            raise ApiKeyRefused(_MISSING)
        caller = self._keys.authenticate(token, refresh=False)
        if caller is None:
            raise ApiKeyRefused(_INVALID)
        problem = reserved_tenant_problem(caller.tenant)
        if problem is not None and not caller.admin:  # a key made by an older version
            raise ApiKeyRefused(f"This key's {problem}; make a key for another tenant.")
        return caller

    def guard(self, connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        """Record the caller of a request to a route that needs a key; 401 when it has none."""
        if is_open(handler):
            if not self._keys.has_keys():
                connection.scope.setdefault("state", {})[_CALLER] = EMBEDDED
            return
        connection.scope.setdefault("state", {})[_CALLER] = self._caller(connection.scope)

    def unrouted(self, request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, object]]:
        """The answer to a request no route handler took (404, 405): 401 without a valid key."""
        try:
            self._caller(request.scope)
        except ApiKeyRefused as refused:
            return refused_response(request, refused)
        return handle_http_error(request, exc)


def refused_response(_: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, object]]:
    """401 in OpenAI's shape, with ``WWW-Authenticate: Bearer``."""
    message = exc.detail if isinstance(exc, HTTPException) else _INVALID
    return error_response(
        401,
        message,
        type_="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="batchgen"'},
    )


def open_options_of_open_routes(app: Litestar) -> None:
    """Declare open the ``OPTIONS`` handler Litestar adds to a route whose other handlers are open
    (it only lists the route's methods); every other route's ``OPTIONS`` needs a key like the rest."""
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        handlers = [handler for handler, _ in route.route_handler_map.values()]
        if any(is_open(handler) for handler in handlers if "OPTIONS" not in handler.http_methods):
            for handler in handlers:
                if handler.http_methods == {"OPTIONS"}:
                    handler.opt[OPEN] = True


def provide_caller(request: Request[Any, Any, Any]) -> Caller:
    """The caller the check recorded; 401 when none was (never a fallback to the admin caller)."""
    caller = request.scope.get("state", {}).get(_CALLER)
    if not isinstance(caller, Caller):
        raise ApiKeyRefused(_MISSING)
    return caller
