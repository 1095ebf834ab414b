"""Monitoring routes: ``/v1/pool/status``, ``/health``, ``/v1/models`` and ``/v1/models/{id}``."""

from __future__ import annotations

from typing import Any

from litestar import HttpMethod, Request, Response, route
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import FromPath

from batchgen.core.service import BatchService
from batchgen.core.tenancy import EMBEDDED, Caller
from batchgen.server.auth import OPEN_ROUTE
from batchgen.server.etags import json_with_etag

_READ = [HttpMethod.GET, HttpMethod.HEAD]


@route("/v1/pool/status", http_method=_READ)
async def pool_status(
    request: Request[Any, Any, Any], service: NamedDependency[BatchService], caller: NamedDependency[Caller]
) -> Response[dict[str, Any]]:
    """The pools' figures; once API keys exist, also per tenant (every tenant for an admin key,
    else the caller's own). From memory, with an ETag; 304 when If-None-Match matches."""
    figures = service.pool_status().to_dict()
    if caller is not EMBEDDED:  # a server with keys
        figures["tenants"] = service.tenant_status(caller)
    return json_with_etag(request, figures)


@route("/health", http_method=_READ, opt=OPEN_ROUTE)
async def health(service: NamedDependency[BatchService]) -> Response[dict[str, Any]]:
    """200 while requests can run; with several models, each model's state (``degraded`` while
    some, not all, are unavailable); 503 when none can run."""
    report = service.health_report()
    healthy = report["status"] != "unhealthy"
    headers = None if healthy else {"Retry-After": "5"}
    return Response(report, status_code=200 if healthy else 503, headers=headers)


@route("/v1/models", http_method=_READ)
async def models(service: NamedDependency[BatchService], state: State) -> dict[str, Any]:
    """Every served model under each of its names, with its backend and the endpoints it serves;
    ``unavailable`` lists default models that are not installed."""
    listing: dict[str, Any] = {"object": "list", "data": service.models()}
    missing = state.get("unavailable_models")
    if missing:
        listing["unavailable"] = list(missing)
    return listing


@route("/v1/models/{model_id:path}", http_method=_READ)
async def model(service: NamedDependency[BatchService], model_id: FromPath[str]) -> dict[str, Any]:
    """One served model as ``/v1/models`` lists it (a name may hold slashes, as Hugging Face
    names do); 404 ``model_not_found`` for a name no model answers to."""
    return service.model(model_id.removeprefix("/"))
