"""Prometheus metrics: ``GET /metrics`` in the text exposition format, through prometheus-client.

Each app has its own ``CollectorRegistry`` (never the process-wide one), so several servers in one
process (tests, an embedding) do not clash. Two sources feed it:

- ``ServiceCollector`` reads the service when scraped: the request counters and latency histograms
  of ``RequestTelemetry``, the pools, the active batches by status, health, work paused on a
  storage that refuses result lines, the webhook outbox
  (read from the store just before the scrape, through the service's ``MetadataCalls``) and,
  for the ``openai`` backend, each upstream's in-flight requests, limit, state, failures and how
  often its prompt prefixes' requests kept their affinity to it. Nothing
  is added on the request path beyond the telemetry's integer additions.
- ``HttpMetricsMiddleware`` times every routed HTTP request into ``HttpMetrics``, histograms by
  method, route template (``/v1/batches/{batch_id}``, never the raw path) and status code.

Labels never carry ids or tenant names: their values come from fixed sets (statuses, outcomes,
routes, methods, codes) or from the server's configuration (upstream host:port).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from litestar import HttpMethod, Response, route
from litestar.datastructures import State
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from batchgen.core.execution.result_cache import CacheCounts
from batchgen.core.models import BatchStatus
from batchgen.core.service import BatchService
from batchgen.core.storage.faults import is_storage_fault
from batchgen.core.telemetry import Histogram as TelemetryHistogram
from batchgen.server.webhooks import DeliveryCounts

#: Statuses ``batchgen_batches`` reports (the active ones; ended batches are in the database).
ACTIVE_STATUSES = tuple(status for status in BatchStatus if status.is_active)
#: Bounds (seconds) of the HTTP request duration histogram.
HTTP_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PATH_PARAMETER_TYPE = re.compile(r"\{(\w+):[^}]*\}")


def route_template(template: str) -> str:
    """Litestar's path template without parameter types: ``/v1/batches/{batch_id}``."""
    return _PATH_PARAMETER_TYPE.sub(r"{\1}", template) or "/"


def upstream_labels(urls: list[str]) -> list[str]:
    """A label per upstream URL: its host:port (never its userinfo), or its position when two share one."""
    hosts = [urlsplit(url).netloc.rpartition("@")[2] for url in urls]
    return [host if hosts.count(host) == 1 else str(index) for index, host in enumerate(hosts)]


def _buckets(histogram: TelemetryHistogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs as prometheus-client takes them."""
    return [
        ("+Inf" if bound == float("inf") else repr(bound), count) for bound, count in histogram.cumulative()
    ]


def _histogram(name: str, documentation: str, histogram: TelemetryHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, buckets=_buckets(histogram), sum_value=histogram.total)


def result_cache_metrics(service: BatchService) -> Iterator[Metric]:
    """The result cache's counters since the start and its size now (zeros while it is off)."""
    cache = service.result_cache
    counts = CacheCounts() if cache is None else cache.counts
    lookups = CounterMetricFamily(
        "batchgen_result_cache_lookups",
        "Deterministic requests of tenants using the result cache, by whether the cache answered them.",
        labels=["result"],
    )
    lookups.add_metric(["hit"], counts.hits)
    lookups.add_metric(["miss"], counts.misses)
    yield lookups
    saved = CounterMetricFamily(
        "batchgen_result_cache_saved_tokens",
        "Tokens of the answers the result cache replayed, which were not computed again.",
        labels=["kind"],
    )
    saved.add_metric(["prompt"], counts.saved_prompt_tokens)
    saved.add_metric(["completion"], counts.saved_completion_tokens)
    yield saved
    yield CounterMetricFamily(
        "batchgen_result_cache_evictions",
        "Result cache entries evicted to keep its bounds.",
        value=counts.evicted,
    )
    yield GaugeMetricFamily(
        "batchgen_result_cache_entries",
        "Entries in the result cache.",
        value=0 if cache is None else cache.entries,
    )
    yield GaugeMetricFamily(
        "batchgen_result_cache_waiting_entries",
        "New result cache entries kept in memory until the next write to its file (every 0.2 s).",
        value=0 if cache is None else cache.waiting,
    )
    yield GaugeMetricFamily(
        "batchgen_result_cache_bytes",
        "Bytes the result cache's entries count against --result-cache-max-bytes.",
        value=0 if cache is None else cache.bytes,
    )


class ServiceCollector(Collector):
    """The service's state, read at scrape time."""

    def __init__(self, service: BatchService) -> None:
        self._service = service
        #: Webhook messages waiting, read by ``read_store`` just before a scrape (None: not read).
        self._pending_webhooks: int | None = None

    async def read_store(self) -> None:
        """Read what the scrape reports from the metadata store, through the service's calls (so
        off the event loop for a store across a network); a store that cannot be read leaves its
        figures out of this scrape."""
        self._pending_webhooks = None
        service = self._service
        if not service.running:
            return
        try:
            self._pending_webhooks = await service.parts.calls(service.metadata.pending_webhooks)
        except Exception as exc:
            if not is_storage_fault(exc):
                raise

    def collect(self) -> Iterator[Metric]:
        service = self._service
        telemetry = service.telemetry
        finished = CounterMetricFamily(
            "batchgen_requests_finished",
            "Requests that ended with a line in their batch's results, by outcome.",
            labels=["outcome"],
        )
        finished.add_metric(["completed"], telemetry.completed)
        finished.add_metric(["failed"], telemetry.failed)
        yield finished
        yield CounterMetricFamily(
            "batchgen_generated_tokens",
            "Completion tokens of completed requests.",
            value=telemetry.generated_tokens,
        )
        yield CounterMetricFamily(
            "batchgen_prompt_tokens", "Prompt tokens of completed requests.", value=telemetry.prompt_tokens
        )
        yield CounterMetricFamily(
            "batchgen_prefix_cached_tokens",
            "Prompt tokens of completed requests that the engines' prefix caches served, as the backends report them.",
            value=telemetry.prefix_cached_tokens,
        )
        yield _histogram(
            "batchgen_request_backend_seconds",
            "Time one request spent inside the backend (retries included).",
            telemetry.backend_latency,
        )
        yield _histogram(
            "batchgen_request_queue_wait_seconds",
            "Time from a request's batch being queued to the request getting a slot.",
            telemetry.queue_wait,
        )
        pools = service.pool_status()
        held = service.parts.executor.held if service.running else None
        for name, documentation, value in (
            (
                "batchgen_intake_queued_requests",
                "Requests waiting in the intake pool.",
                pools.intake_pool_size,
            ),
            (
                "batchgen_intake_reserved_requests",
                "Intake places held for accepted batches not queued yet.",
                service.intake_pool.reserved,
            ),
            ("batchgen_intake_capacity", "Most requests the intake pool holds.", pools.intake_pool_capacity),
            (
                "batchgen_slots_active",
                "Scheduling pool slots running a request.",
                pools.scheduling_pool_active,
            ),
            ("batchgen_slots_capacity", "Scheduling pool slots.", pools.scheduling_pool_capacity),
            (
                "batchgen_backend_healthy",
                "1 while the service and its backend can run requests.",
                int(service.health().healthy),
            ),
            (
                "batchgen_storage_paused",
                "1 while work is paused because the storage refuses result lines (a full disk).",
                int(held is not None and held.paused),
            ),
            (
                "batchgen_held_result_lines",
                "Result lines kept in memory until the storage takes them again.",
                0 if held is None else held.lines,
            ),
        ):
            yield GaugeMetricFamily(name, documentation, value=value)
        yield self._batches()
        yield GaugeMetricFamily(
            "batchgen_batches_at_risk",
            "Running batches whose recent pace says they will not finish by their expires_at.",
            value=service.batches_at_risk(),
        )
        yield from self._outbox()
        yield from self._replica()
        yield from self._upstreams()
        yield from result_cache_metrics(service)

    def _batches(self) -> Metric:
        counts = dict.fromkeys(ACTIVE_STATUSES, 0)
        for status, count in self._service.active_batch_statuses().items():
            if status in counts:
                counts[status] += count
        batches = GaugeMetricFamily("batchgen_batches", "Active batches by status.", labels=["status"])
        for status, count in counts.items():
            batches.add_metric([status.value], count)
        return batches

    def _outbox(self) -> Iterator[Metric]:
        pending = self._pending_webhooks
        if pending is None:  # not running, or the database cannot be read now: the scrape goes on
            return
        yield GaugeMetricFamily(
            "batchgen_webhook_outbox_messages",
            "Webhook messages waiting for delivery (or a retry).",
            value=pending,
        )

    def _replica(self) -> Iterator[Metric]:
        """A replica's share of the shared work (``--metadata-url``), labelled with its id."""
        replica = self._service.replica
        if replica is None:
            return
        runner, labels = replica.runner, [replica.replica_id]
        held = GaugeMetricFamily(
            "batchgen_replica_shards_held", "Shards this replica holds a lease on now.", labels=["replica"]
        )
        held.add_metric(labels, len(runner.held))
        yield held
        for name, documentation, value in (
            ("batchgen_replica_lines_committed", "Lines this replica committed.", runner.lines_committed),
            (
                "batchgen_replica_leases_lost",
                "Leases this replica lost (run out, taken over, or its batch cancelled or ended).",
                runner.leases_lost + runner.shards_cancelled,
            ),
            (
                "batchgen_replica_commits_refused",
                "Commits the ledger refused to this replica (its lease was no longer its own).",
                runner.commits_refused,
            ),
        ):
            counter = CounterMetricFamily(name, documentation, labels=["replica"])
            counter.add_metric(labels, value)
            yield counter

    def _upstreams(self) -> Iterator[Metric]:
        upstreams = getattr(self._service.backend, "upstreams", None)
        if not isinstance(upstreams, list) or not upstreams:
            return
        labels = upstream_labels([upstream.url for upstream in upstreams])
        in_flight = GaugeMetricFamily(
            "batchgen_upstream_in_flight", "Requests in flight to each upstream.", labels=["upstream"]
        )
        limit = GaugeMetricFamily(
            "batchgen_upstream_concurrency_limit",
            "Each upstream's adaptive concurrency limit now.",
            labels=["upstream"],
        )
        up = GaugeMetricFamily("batchgen_upstream_up", "1 while an upstream is up.", labels=["upstream"])
        errors = CounterMetricFamily(
            "batchgen_upstream_errors", "Failed attempts on each upstream.", labels=["upstream"]
        )
        affinity = CounterMetricFamily(
            "batchgen_upstream_prefix_requests",
            "Requests whose prompt prefix belongs to each upstream, by whether they went there "
            "(kept) or elsewhere because it was down or saturated.",
            labels=["upstream", "affinity"],
        )
        for label, upstream in zip(labels, upstreams, strict=True):
            in_flight.add_metric([label], upstream.in_flight)
            limit.add_metric([label], upstream.limit.limit)
            up.add_metric([label], 0 if upstream.health.down else 1)
            errors.add_metric([label], upstream.failures)
            for outcome, count in upstream.affinity.items():
                affinity.add_metric([label, outcome], count)
        yield from (in_flight, limit, up, errors, affinity)


class HttpMetrics(Collector):
    """The HTTP request duration histogram of one app, by (method, route template, status)."""

    def __init__(self) -> None:
        self._histograms: dict[tuple[str, str, str], TelemetryHistogram] = {}

    def observe(self, method: str, route: str, status: str, seconds: float) -> None:
        key = (method, route, status)
        histogram = self._histograms.get(key)
        if histogram is None:
            histogram = self._histograms[key] = TelemetryHistogram(HTTP_DURATION_BUCKETS_S)
        histogram.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "batchgen_http_request_duration_seconds",
            "HTTP request duration by method, route template and status code.",
            labels=["method", "route", "status"],
        )
        for labels, histogram in list(self._histograms.items()):
            family.add_metric(list(labels), _buckets(histogram), histogram.total)
        yield family


class HttpMetricsMiddleware(ASGIMiddleware):
    """Times each routed HTTP request (requests matching no route are not counted)."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, metrics: HttpMetrics) -> None:
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        started = time.perf_counter()
        status = 500

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await next_app(scope, receive, send_recording)
        finally:
            route = route_template(scope.get("path_template") or "unmatched")
            method = str(scope.get("method", "GET"))
            self.metrics.observe(method, route, str(status), time.perf_counter() - started)


class WebhookCollector(Collector):
    """Webhook delivery attempts since start, by outcome."""

    def __init__(self, counts: DeliveryCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        attempts = CounterMetricFamily(
            "batchgen_webhook_deliveries",
            "Webhook delivery attempts by outcome: delivered, failed (retried later), abandoned (after a day).",
            labels=["outcome"],
        )
        for outcome in ("delivered", "failed", "abandoned"):
            attempts.add_metric([outcome], getattr(self._counts, outcome))
        yield attempts


def build_registry(service: BatchService) -> tuple[CollectorRegistry, HttpMetrics, ServiceCollector]:
    registry = CollectorRegistry(auto_describe=False)
    collector = ServiceCollector(service)
    registry.register(collector)
    http = HttpMetrics()
    registry.register(http)
    return registry, http, collector


@route("/metrics", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False)
async def metrics(state: State) -> Response[bytes]:
    """The app's registry in Prometheus' text format (``HEAD`` answers the same headers, no body)."""
    registry: Any = state.metrics_registry
    await state.service_collector.read_store()
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
