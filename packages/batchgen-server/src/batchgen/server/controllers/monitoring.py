"""Monitoring routes: ``/v1/pool/status``, ``/health`` and ``/v1/models``."""

from __future__ import annotations

from typing import Any

from litestar import Response, get

from batchgen.core.service import BatchService
from batchgen.core.tenancy import EMBEDDED, Caller


@get("/v1/pool/status")
async def pool_status(service: BatchService, caller: Caller) -> dict[str, Any]:
    """The pools' figures; once API keys exist, also per tenant (every tenant for an admin key,
    else the caller's own)."""
    figures = service.pool_status().to_dict()
    if caller is not EMBEDDED:  # a server with keys
        figures["tenants"] = service.tenant_status(caller)
    return figures


@get("/health")
async def health(service: BatchService) -> Response[dict[str, Any]]:
    state = service.health()
    headers = None if state.healthy else {"Retry-After": "5"}
    return Response(state.to_dict(), status_code=200 if state.healthy else 503, headers=headers)


@get("/v1/models")
async def models(service: BatchService) -> dict[str, Any]:
    return {"object": "list", "data": service.models()}
