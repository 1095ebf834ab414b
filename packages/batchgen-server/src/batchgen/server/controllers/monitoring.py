"""Monitoring routes: ``/v1/pool/status``, ``/health`` and ``/v1/models``."""

from __future__ import annotations

from typing import Any

from litestar import Response, get

from batchgen.core.service import BatchService


@get("/v1/pool/status")
async def pool_status(service: BatchService) -> dict[str, Any]:
    return service.pool_status().to_dict()


@get("/health")
async def health(service: BatchService) -> Response[dict[str, Any]]:
    state = service.health()
    headers = None if state.healthy else {"Retry-After": "5"}
    return Response(state.to_dict(), status_code=200 if state.healthy else 503, headers=headers)


@get("/v1/models")
async def models(service: BatchService) -> dict[str, Any]:
    return {"object": "list", "data": service.models()}
