"""``GET /metrics``: scraped and parsed with prometheus-client's own parser while batches run.

The figures must move as a batch runs and, at its end, equal the batch's own request counts and
token usage; labels carry no ids; each app has its own registry.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from litestar import Litestar
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from batchgen.core.service import BatchService
from batchgen.server.app import create_app
from batchgen.server.metrics import route_template, upstream_labels
from batchgen.server.settings import ServerSettings
from tests.core.test_openai_upstream import FakeFleet
from tests.core.test_storage_faults import DISK_FULL, FaultyMetadata
from tests.helpers import chat_line, create_batch, jsonl, upload, wait_for_status
from tests.live import LiveServer

ApiFactory = Callable[..., TestClient[Litestar]]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: httpx.Client) -> Samples:
    """Every sample of ``/metrics``, by (sample name, labels)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_metrics_move_as_a_batch_runs_and_end_equal_to_its_counts(
    server_factory: Callable[..., LiveServer],
) -> None:
    server = server_factory(
        "--simulated-latency-s", "0.05", "--max-pool-size", "4", "--max-context-length", "40"
    )
    long_prompt = " ".join(["word"] * 60)  # longer than the context: an error line
    lines = [chat_line(f"r{i}", long_prompt if i % 10 == 0 else f"prompt {i}") for i in range(120)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        before = scrape(client)
        assert value(before, "batchgen_requests_finished_total", outcome="completed") == 0
        assert value(before, "batchgen_slots_capacity") == 4
        assert value(before, "batchgen_backend_healthy") == 1
        batch = create_batch(client, upload(client, jsonl(*lines))["id"])

        seen_running = seen_partial = False
        previous = 0.0
        deadline = time.monotonic() + 60
        while not (seen_running and seen_partial):
            assert time.monotonic() < deadline, "the metrics did not move while the batch ran"
            samples = scrape(client)
            completed = value(samples, "batchgen_requests_finished_total", outcome="completed")
            assert completed >= previous, "a counter went down"
            previous = completed
            if value(samples, "batchgen_batches", status="in_progress") == 1:
                seen_running = seen_running or value(samples, "batchgen_slots_active") > 0
                seen_partial = seen_partial or 0 < completed < 108
            time.sleep(0.02)

        ended = wait_for_status(client, batch["id"], {"completed"})
        after = scrape(client)

    counts, usage = ended["request_counts"], ended["usage"]
    assert (counts["completed"], counts["failed"]) == (108, 12)
    assert value(after, "batchgen_requests_finished_total", outcome="completed") == counts["completed"]
    assert value(after, "batchgen_requests_finished_total", outcome="failed") == counts["failed"]
    assert value(after, "batchgen_generated_tokens_total") == usage["output_tokens"]
    assert value(after, "batchgen_prompt_tokens_total") == usage["input_tokens"]
    assert value(after, "batchgen_request_queue_wait_seconds_count") == 120
    assert value(after, "batchgen_request_backend_seconds_count") == 120
    assert value(after, "batchgen_request_backend_seconds_sum") >= 120 * 0.05 * 0.9
    assert value(after, "batchgen_request_queue_wait_seconds_bucket", le="+Inf") == 120
    for status in ("validating", "in_progress", "finalizing", "cancelling"):
        assert value(after, "batchgen_batches", status=status) == 0
    assert value(after, "batchgen_slots_active") == value(after, "batchgen_intake_queued_requests") == 0

    routes = {dict(labels)["route"] for (name, labels) in after if name.startswith("batchgen_http_request")}
    assert {"/v1/batches/{batch_id}", "/v1/files", "/v1/batches", "/metrics"} <= routes
    ids = re.compile(r"(batch_|file-|req_)[0-9a-f]{12}")
    assert not [labels for (_, labels) in after for _, text in labels if ids.search(text)], (
        "a label carries an id"
    )


def test_each_app_has_its_own_registry(api_factory: ApiFactory) -> None:
    busy = api_factory(storage="busy")
    idle = api_factory(storage="idle")
    batch = create_batch(busy, upload(busy, jsonl(chat_line("a"), chat_line("b")))["id"])
    wait_for_status(busy, batch["id"], {"completed"})
    assert value(scrape(busy), "batchgen_requests_finished_total", outcome="completed") == 2
    assert value(scrape(idle), "batchgen_requests_finished_total", outcome="completed") == 0


def test_openai_backend_reports_each_upstream(tmp_path: Path) -> None:
    fleet = FakeFleet(2)
    fleet[1].mode = "status"  # 503: an overload, retried on the other upstream
    settings = ServerSettings(storage_path=tmp_path, backend="openai")
    service = BatchService(settings.service_settings(), fleet.backend(failures_to_mark_down=100))
    with TestClient(create_app(settings, service), timeout=30) as client:
        batch = create_batch(client, upload(client, jsonl(*[chat_line(f"r{i}") for i in range(20)]))["id"])
        ended = wait_for_status(client, batch["id"], {"completed"})
        samples = scrape(client)
    assert ended["request_counts"]["completed"] == 20
    labels = ["up0:8000", "up1:8000"]
    assert value(samples, "batchgen_upstream_errors_total", upstream=labels[0]) == 0
    assert value(samples, "batchgen_upstream_errors_total", upstream=labels[1]) == len(fleet[1].bodies) > 0
    for label in labels:
        assert value(samples, "batchgen_upstream_in_flight", upstream=label) == 0
        assert value(samples, "batchgen_upstream_concurrency_limit", upstream=label) >= 1
        assert value(samples, "batchgen_upstream_up", upstream=label) == 1
    # each of the 20 requests' first attempt is counted once, on its prompt prefix's upstream
    affinity = [
        value(samples, "batchgen_upstream_prefix_requests_total", upstream=label, affinity=outcome)
        for label in labels
        for outcome in ("kept", "down", "saturated")
    ]
    assert sum(affinity) == 20


def test_route_templates_and_upstream_labels() -> None:
    assert route_template("/v1/batches/{batch_id:str}/cancel") == "/v1/batches/{batch_id}/cancel"
    assert route_template("/v1/files") == "/v1/files"
    assert upstream_labels(["http://a:1/v1", "http://b:2/v1"]) == ["a:1", "b:2"]
    assert upstream_labels(["http://a:1/v1", "http://a:1/other"]) == ["0", "1"], "labels stay unique"


def test_a_scrape_while_the_database_fails_still_answers(tmp_path: Path) -> None:
    settings = ServerSettings(storage_path=tmp_path, backend="simulated")
    service = BatchService(
        settings.service_settings(), settings.build_backend(), open_metadata=FaultyMetadata
    )
    with TestClient(create_app(settings, service), timeout=30) as client:
        service.metadata.faults["pending_webhooks"] = DISK_FULL  # type: ignore[attr-defined]
        samples = scrape(client)
    assert value(samples, "batchgen_backend_healthy") == 1
    assert not [name for name, _ in samples if name == "batchgen_webhook_outbox_messages"]
