"""Request telemetry: the counters and histograms /metrics exports, checked against the batches run."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.telemetry import Histogram, RequestTelemetry

CHAT = "/v1/chat/completions"


@given(
    bounds=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=12, unique=True).map(sorted),
    values=st.lists(st.floats(0, 2e6, allow_nan=False), max_size=60),
)
def test_histogram_counts_each_value_in_its_bucket(bounds: list[float], values: list[float]) -> None:
    histogram = Histogram(bounds)
    for value in values:
        histogram.observe(value)
    assert histogram.count == len(values)
    assert histogram.total == pytest.approx(sum(values))
    for bound, at_most in histogram.cumulative():
        assert at_most == sum(1 for value in values if value <= bound)


def test_histogram_bounds_must_increase() -> None:
    with pytest.raises(ValueError, match="increase"):
        Histogram([1.0, 1.0])


def test_queue_wait_is_measured_from_when_the_batch_was_queued() -> None:
    now = [100.0]
    telemetry = RequestTelemetry(clock=lambda: now[0])
    telemetry.requests_admitted("batch_unknown", 1)  # never queued (a resumed request's batch ended): no wait
    telemetry.batch_queued("batch_a")
    now[0] = 103.0
    telemetry.requests_admitted("batch_a", 1)
    telemetry.batch_ended("batch_a")
    telemetry.requests_admitted("batch_a", 1)
    assert (telemetry.queue_wait.count, telemetry.queue_wait.total) == (1, 3.0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_counters_equal_the_batches_counts_and_usage(tmp_path: Path) -> None:
    short = {"role": "user", "content": "hi"}
    long = {"role": "user", "content": " ".join(["word"] * 80)}  # beyond the context: an error line
    lines = [
        msgspec.json.encode(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": CHAT,
                "body": {"messages": [long if i % 4 == 0 else short]},
            }
        )
        + b"\n"
        for i in range(40)
    ]
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=3)
    async with BatchService(settings, SimulatedBackend(latency_s=0.001, context_length=50)) as service:
        file = await service.create_file(b"".join(lines))
        batches = [await service.wait_for_batch((await service.create_batch(file.id, CHAT)).id)]
        batches.append(await service.wait_for_batch((await service.create_batch(file.id, CHAT)).id))
        telemetry = service.telemetry
    assert telemetry.completed == sum(batch.request_counts.completed for batch in batches) == 60
    assert telemetry.failed == sum(batch.request_counts.failed for batch in batches) == 20
    assert telemetry.generated_tokens == sum(batch.usage.completion_tokens for batch in batches)
    assert telemetry.prompt_tokens == sum(batch.usage.prompt_tokens for batch in batches)
    assert telemetry.queue_wait.count == telemetry.backend_latency.count == 80
