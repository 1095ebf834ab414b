"""The running totals of the pool status against what the batches say, whatever happens to them:
requests that complete, requests that fail, batches cancelled at any moment. Hypothesis picks
the batches, their sizes and failures and when each is cancelled; the embedded service runs them
on the simulated backend."""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
from pathlib import Path

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import Conflict
from tests.examples import examples

LONG = "word " * 40  # over the backend's context of 20: an error line


def _lines(size: int, failing: int) -> bytes:
    rows = []
    for i in range(size):
        content = LONG if i < failing else f"question {i}"
        body = {"messages": [{"role": "user", "content": content}]}
        rows.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


plans = st.lists(
    st.tuples(
        st.integers(1, 25),  # requests
        st.integers(0, 5),  # of which fail
        st.none() | st.integers(0, 30),  # cancelled after this many ms (None: runs to its end)
    ),
    min_size=1,
    max_size=4,
)


async def _run(storage: Path, plan: list[tuple[int, int, int | None]], slots: int) -> None:
    backend = SimulatedBackend(latency_s=0.002, context_length=20)
    async with BatchService(ServiceSettings(storage_path=storage, max_pool_size=slots), backend) as service:
        batches = []
        for size, failing, _ in plan:
            file = await service.create_file(_lines(size, min(failing, size)), filename="in.jsonl")
            batches.append(await service.create_batch(file.id, "/v1/chat/completions"))
        seen = []
        for batch, (_, _, cancel_after_ms) in zip(batches, plan, strict=True):
            if cancel_after_ms is not None:
                await anyio.sleep(cancel_after_ms / 1000)
                with contextlib.suppress(Conflict):  # it had ended already
                    await service.cancel_batch(batch.id)
            seen.append(service.pool_status())
        ended = [await service.wait_for_batch(batch.id) for batch in batches]
        await service.scheduler.wait_until_idle()
        seen.append(service.pool_status())
    totals = seen[-1]
    for earlier, later in itertools.pairwise(seen):  # never down
        assert later.requests_completed_total >= earlier.requests_completed_total
        assert later.completion_tokens_total >= earlier.completion_tokens_total
    assert totals.requests_completed_total == sum(b.request_counts.completed for b in ended)
    assert totals.requests_failed_total == sum(b.request_counts.failed for b in ended)
    assert totals.prompt_tokens_total == sum(b.usage.prompt_tokens for b in ended)
    assert totals.completion_tokens_total == sum(b.usage.completion_tokens for b in ended)


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans, st.integers(1, 6))
def test_the_totals_equal_the_sum_of_every_batch_s_counts(
    plan: list[tuple[int, int, int | None]], slots: int
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        anyio.run(_run, Path(folder), plan, slots)
