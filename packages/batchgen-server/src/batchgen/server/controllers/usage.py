"""``/v1/usage``: requests and tokens per tenant, over all time (admins see every tenant)."""

from __future__ import annotations

from typing import Any

from litestar import HttpMethod, route
from litestar.di import NamedDependency

from batchgen.core.service import BatchService
from batchgen.core.tenancy import Caller


@route("/v1/usage", http_method=[HttpMethod.GET, HttpMethod.HEAD])
async def usage(service: NamedDependency[BatchService], caller: NamedDependency[Caller]) -> dict[str, Any]:
    """``{"object": "list", "data": [{"tenant", "requests", "prompt_tokens", ...}]}``."""
    figures = await service.usage(caller=caller)
    return {"object": "list", "data": [tenant.to_dict() for tenant in figures]}
