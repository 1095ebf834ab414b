"""The dashboard: ``GET /`` serves the operators' page, ``GET /ui/{name}`` its script and style,
``GET /favicon.ico`` its icon.

The page is HTML rendered here with the served model(s) and backend and the server's state as
it is now (``dashboard_snapshot``: health, and without API keys the pools and the first page of
batches), so its first paint already shows them; the script then reads the API itself
(``/health``, ``/v1/pool/status``, ``/v1/batches``, result files by ``Range``). All files ship in
this package (``batchgen/server/dashboard/``): no build step, nothing fetched from elsewhere. They
are served without an API key: once a key exists the page holds no tenant's data, and asks for a
key.
"""

from __future__ import annotations

import functools
import html
from importlib.resources import files
from string import Template
from typing import Any

from litestar import HttpMethod, MediaType, Request, Response, route
from litestar.di import NamedDependency
from litestar.params import FromPath

from batchgen.core.errors import NotFound
from batchgen.core.service import BatchService
from batchgen.core.tenancy import EMBEDDED
from batchgen.server import dashboard_snapshot as snapshots
from batchgen.server.auth import OPEN_ROUTE, ApiKeyRefused, provide_caller

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
_ICON_HEADERS = {"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"}


@functools.cache
def _read(name: str) -> bytes:
    return (files("batchgen.server") / "dashboard" / name).read_bytes()


def _rate_note(pool: dict[str, Any] | None, what: str) -> str:
    if pool is None:
        return ""
    return f"{what}, exponentially weighted over {pool['rate_time_constant_s']:.0f} s"


def tokens_note(pool: dict[str, Any] | None) -> str:
    """How the tokens/s figure is counted (dashboard.js says the same)."""
    if pool is None:
        return ""
    as_generated = pool["generated_tokens_counted"] == "as_generated"
    counted = "counted as generated" if as_generated else "counted as requests finish"
    return _rate_note(pool, counted)


def render_page(service: BatchService, snapshot: snapshots.Snapshot | None = None) -> str:
    """The page, with the names of the served models and the backend filled in, and the
    server's state (``snapshot``; none: health only, as when a key is needed)."""
    names = [model["id"] for model in service.models()]
    if snapshot is None:
        report = service.health_report()
        snapshot = snapshots.Snapshot(report, report.get("status") != "unhealthy", None, None, 0.0)
    pool = snapshot.pool
    health_text, health_state = snapshots.health_text(snapshot)
    return Template(_read("page.html").decode()).substitute(
        title=html.escape(names[0] if names else "dashboard"),
        models=html.escape(", ".join(names) or "none"),
        backend=html.escape(service.backend.name),
        health_text=html.escape(health_text),
        health_state=health_state,
        updated="",
        intake_text=html.escape(snapshots.intake_text(pool)),
        engine_text=html.escape(snapshots.engine_text(pool)),
        active_text=snapshots.active_text(pool),
        tokens_rate=snapshots.NO_VALUE if pool is None else f"{pool['tokens_per_second']:,.1f}",
        requests_rate=snapshots.NO_VALUE if pool is None else f"{pool['requests_per_second']:,.2f}",
        tokens_note=html.escape(tokens_note(pool)),
        requests_note=html.escape(_rate_note(pool, "ended requests")),
        batch_rows=snapshots.batch_rows(snapshot),
        replica_rows=snapshots.replica_rows(pool),
        replicas_hidden="" if pool is not None and pool.get("replicas") else " hidden",
        snapshot=snapshot.to_json(),
    )


def _tenant_data_allowed(request: Request[Any, Any, Any]) -> bool:
    """Whether the page may hold the pools and batches: only while the server has no API keys
    (the access check then recorded the embedded caller for this open route)."""
    try:
        return provide_caller(request) is EMBEDDED
    except ApiKeyRefused:
        return False


@route("/", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False, opt=OPEN_ROUTE)
async def dashboard(request: Request[Any, Any, Any], service: NamedDependency[BatchService]) -> Response[str]:
    snapshot = await snapshots.take(service, tenant_data=_tenant_data_allowed(request))
    return Response(render_page(service, snapshot), media_type=MediaType.HTML, headers=_PAGE_HEADERS)


@route(
    "/ui/{name:str}", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False, opt=OPEN_ROUTE
)
async def dashboard_asset(name: FromPath[str]) -> Response[bytes]:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"The dashboard has no file '{name}'.")
    return Response(_read(name), media_type=media_type, headers=_HEADERS)


@route("/favicon.ico", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False, opt=OPEN_ROUTE)
async def favicon() -> Response[bytes]:
    """The page's icon, for the browsers that ask for it whatever the page links."""
    return Response(_read("favicon.ico"), media_type="image/x-icon", headers=_ICON_HEADERS)
