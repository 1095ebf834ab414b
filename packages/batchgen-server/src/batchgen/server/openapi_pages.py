"""Litestar's OpenAPI pages (``/schema``, ``/schema/openapi.json``, ...): their configuration.

The pages are declared open (they describe the API and hold no data). Litestar routes them for GET
only; once its render plugins have put their pages on the router, every GET page gets a HEAD twin
(the same handler), so they answer HEAD as every GET route of the server does: the same status
and headers, no body (the server sends none for HEAD), an unknown ``/schema/...`` page a 404.
"""

from __future__ import annotations

from litestar import HttpMethod, Router, route
from litestar.openapi import OpenAPIConfig
from litestar.routes import HTTPRoute

from batchgen.server.auth import OPEN_ROUTE


def openapi_config() -> OpenAPIConfig:
    """Litestar's default OpenAPI pages under ``/schema``, open, each answering GET and HEAD."""
    router = Router("/schema", route_handlers=[], include_in_schema=False, opt=OPEN_ROUTE)
    config = OpenAPIConfig(title="Litestar API", version="1.0.0", openapi_router=router)
    last = config.render_plugins[-1]  # Litestar hands the router to each plugin in turn, last
    receive_router = last.receive_router

    def then_add_head(router: Router) -> None:
        receive_router(router)
        add_head_twins(router)

    setattr(last, "receive_router", then_add_head)  # noqa: B010  (an instance's method, replaced)
    return config


def add_head_twins(router: Router) -> None:
    """Give each GET route of ``router`` that takes no HEAD a HEAD handler: its GET handler's."""
    for page in list(router.routes):
        if not isinstance(page, HTTPRoute) or "GET" not in page.methods or "HEAD" in page.methods:
            continue
        path = page.path.removeprefix(router.path) or "/"
        for handler in page.route_handlers:
            if "GET" in handler.http_methods:
                twin = route(
                    path,
                    http_method=[HttpMethod.HEAD],
                    media_type=handler.media_type,
                    sync_to_thread=False,
                    include_in_schema=False,
                )
                router.register(twin(handler.fn))
