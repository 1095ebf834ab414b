"""``create_app``: the Litestar application, wired to one BatchService started in its lifespan.

If the service's core stops while the app runs (a supervised background task crashed, or the
service's task group ended), ``on_service_stopped(reason)`` is called, so that the process running
the app can exit non-zero and be restarted (``cli`` does).

Access is decided per matched route (``auth``): once a key exists, every route not declared open
needs one, and the ``caller`` dependency tells each controller which tenant is calling. A path
that is not canonical is refused before routing (``request_paths``). Every response, that refusal
included, names its request in ``x-request-id`` (``request_ids``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException
from litestar.middleware import DefineMiddleware

from batchgen.core.errors import BatchGenError
from batchgen.core.service import BatchService
from batchgen.server.api_keys import LAST_USED_SAVE_INTERVAL_S, open_key_store
from batchgen.server.auth import (
    ApiKeyRefused,
    KeyCheck,
    open_options_of_open_routes,
    provide_caller,
    refused_response,
)
from batchgen.server.body_timeout import BodyTimeout, BodyTimeoutMiddleware, handle_body_timeout
from batchgen.server.controllers.batches import BatchesController
from batchgen.server.controllers.dashboard import dashboard, dashboard_asset, favicon
from batchgen.server.controllers.files import FilesController
from batchgen.server.controllers.monitoring import health, model, models, pool_status
from batchgen.server.controllers.retries import RetriesController
from batchgen.server.controllers.uploads import UploadsController
from batchgen.server.controllers.usage import usage
from batchgen.server.errors import handle_http_error, handle_service_error, handle_unexpected_error
from batchgen.server.metrics import HttpMetricsMiddleware, WebhookCollector, build_registry, metrics
from batchgen.server.openapi_pages import openapi_config
from batchgen.server.priority import lower_api_priority, resolve_api_nice
from batchgen.server.request_ids import RequestIds
from batchgen.server.request_paths import CanonicalPaths
from batchgen.server.settings import ServerSettings
from batchgen.server.webhooks import WebhookDeliverer


def _provide_service(state: State) -> BatchService:
    service: BatchService = state.service
    return service


logger = logging.getLogger("batchgen.server")


def create_app(
    settings: ServerSettings | None = None,
    service: BatchService | None = None,
    *,
    on_service_stopped: Callable[[str], object] | None = None,
) -> Litestar:
    """Build the app; the service (made from ``settings`` unless given) runs while the app does."""
    settings = settings or ServerSettings()
    unavailable: list[dict[str, object]] = []
    if service is None:
        served, unavailable = settings.build_models()
        service = BatchService(settings.service_settings(), served)
    registry, http_metrics, service_collector = build_registry(service)
    if service.settings.webhook_urls or service.settings.webhook_batch_urls:
        if settings.webhook_secret is None:
            logger.warning("webhooks are sent unsigned: no --webhook-secret is set")
        deliverer = WebhookDeliverer(
            service,
            secret=settings.webhook_secret,
            timeout_s=settings.webhook_timeout_s,
            retry_initial_s=settings.webhook_retry_initial_s,
        )
        service.maintenance.add("deliver webhooks", settings.webhook_interval_s, deliverer.deliver_due)
        registry.register(WebhookCollector(deliverer.counts))

    def apply_weights(limits: dict[str, Any]) -> None:
        service.set_tenant_limits(limits)  # the weights, and the limits an admin's calls for a tenant meet

    shared = service.settings.shared
    keys = open_key_store(
        service.settings.storage_path,
        None if shared is None else shared.metadata_url,
        on_reload=apply_weights,
        watch=True,
    )

    def save_last_use() -> None:
        keys.save_last_use()

    service.maintenance.add("save API keys' last use", LAST_USED_SAVE_INTERVAL_S, save_last_use)
    key_check = KeyCheck(keys)

    def stopped(reason: str) -> None:
        logger.critical("the batch service stopped: %s", reason)
        if on_service_stopped is not None:
            on_service_stopped(reason)

    @asynccontextmanager
    async def run_service(_: Litestar) -> AsyncIterator[None]:
        started = False
        try:
            async with service:
                started = True
                service.on_stop(stopped)
                # after the backends started their workers and model threads
                cpu_worker = any(getattr(model.backend, "cpu_worker", False) for model in service.model_set)
                lower_api_priority(resolve_api_nice(settings.api_nice, cpu_worker))
                yield
        except BaseException as exc:
            if started:  # the core died under the app (its task group was cancelled by a crash)
                stopped(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            keys.close()

    app = Litestar(
        route_handlers=[
            FilesController,
            UploadsController,
            BatchesController,
            RetriesController,
            pool_status,
            health,
            models,
            model,
            usage,
            metrics,
            dashboard,
            dashboard_asset,
            favicon,
        ],
        dependencies={
            "service": Provide(_provide_service, sync_to_thread=False),
            "caller": Provide(provide_caller, sync_to_thread=False),
        },
        guards=[key_check.guard],
        openapi_config=openapi_config(),
        state=State(
            {
                "service": service,
                "metrics_registry": registry,
                "service_collector": service_collector,
                "unavailable_models": unavailable,
            }
        ),
        lifespan=[run_service],
        logging_config=None,  # the batchgen-server command sets up logging (log_format)
        middleware=[
            HttpMetricsMiddleware(http_metrics),
            DefineMiddleware(BodyTimeoutMiddleware, body_timeout_s=settings.body_timeout_s),
        ],
        exception_handlers={
            BodyTimeout: handle_body_timeout,
            ApiKeyRefused: refused_response,
            NotFoundException: key_check.unrouted,
            MethodNotAllowedException: key_check.unrouted,
            BatchGenError: handle_service_error,
            HTTPException: handle_http_error,
            Exception: handle_unexpected_error,
        },
    )
    keys.has_keys()  # load the keys (and the tenants' weights) now, not on the first request
    open_options_of_open_routes(app)
    app.asgi_handler = RequestIds(CanonicalPaths(app.asgi_handler))
    return app
