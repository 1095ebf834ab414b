"""The dashboard: ``GET /`` serves the operators' page, ``GET /ui/{name}`` its script and style.

The page is HTML rendered here with the served model(s) and backend; the rest it reads from the
API itself (``/health``, ``/v1/pool/status``, ``/v1/batches``, result files by ``Range``) with a
small script. All three files ship in this package (``batchgen/server/dashboard/``): no build
step, nothing fetched from elsewhere. They are served without an API key: the page holds no data,
and asks for a key when the API wants one.
"""

from __future__ import annotations

import functools
import html
from importlib.resources import files
from string import Template

from litestar import HttpMethod, MediaType, Response, route
from litestar.di import NamedDependency
from litestar.params import FromPath

from batchgen.core.errors import NotFound
from batchgen.core.service import BatchService
from batchgen.server.auth import OPEN_ROUTE

#: The assets the page loads, with their media types.
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
#: The page loads only its own files and talks only to this server.
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}
_PAGE_HEADERS = {
    **_HEADERS,
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
}


@functools.cache
def _read(name: str) -> bytes:
    return (files("batchgen.server") / "dashboard" / name).read_bytes()


def render_page(service: BatchService) -> str:
    """The page, with the names of the served models and the backend filled in."""
    names = [model["id"] for model in service.models()]
    return Template(_read("page.html").decode()).substitute(
        title=html.escape(names[0] if names else "dashboard"),
        models=html.escape(", ".join(names) or "none"),
        backend=html.escape(service.backend.name),
    )


@route("/", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False, opt=OPEN_ROUTE)
async def dashboard(service: NamedDependency[BatchService]) -> Response[str]:
    return Response(render_page(service), media_type=MediaType.HTML, headers=_PAGE_HEADERS)


@route(
    "/ui/{name:str}", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False, opt=OPEN_ROUTE
)
async def dashboard_asset(name: FromPath[str]) -> Response[bytes]:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"The dashboard has no file '{name}'.")
    return Response(_read(name), media_type=media_type, headers=_HEADERS)
