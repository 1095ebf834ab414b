"""At-risk batches (``deadline_watch``): the rule from a batch's pace, and the one event per batch.

``will_miss`` is checked against its statement for any pace, count and window; the embedded
service then runs a batch that cannot finish in its window on a slow simulated backend: its
object says ``at_risk``, one ``batch.at_risk`` event is saved with the mark in the outbox, and a
restart (the batch resumed) makes no second one. A batch with time to spare is never at risk.
"""

from __future__ import annotations

import json
import math
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import anyio
import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core import BatchService, BatchStatus, ServiceSettings, load_backend
from batchgen.core.batches.deadline_watch import AT_RISK_EVENT, readable_time, will_miss
from batchgen.core.batches.progress import estimate
from batchgen.core.models import Batch, RequestCounts
from batchgen.core.storage import SQLiteMetadataStore

NOW = 1_800_000_000


def _batch(total: int, done: int, window_s: int, age_s: int, status: BatchStatus) -> Batch:
    created = NOW - age_s
    return Batch(
        id="batch_x",
        endpoint="/v1/chat/completions",
        input_file_id="file_x",
        completion_window=f"{window_s}s",
        status=status,
        created_at=created,
        expires_at=created + window_s,
        model="m",
        request_counts=RequestCounts(total, done, 0),
        in_progress_at=created,
    )


@given(
    total=st.integers(1, 10**6),
    done_share=st.floats(0, 1),
    rate=st.one_of(st.none(), st.just(0.0), st.floats(1e-4, 1e5)),
    window_s=st.integers(1, 365 * 86400),
    age_share=st.floats(0, 1),
    status=st.sampled_from(list(BatchStatus)),
)
def test_at_risk_means_the_pace_ends_the_batch_after_its_deadline(
    total: int,
    done_share: float,
    rate: float | None,
    window_s: int,
    age_share: float,
    status: BatchStatus,
) -> None:
    done = min(total, int(total * done_share))
    age = int(window_s * age_share)
    batch = _batch(total, done, window_s, age, status)
    progress = estimate(rate, total - done)
    if progress.seconds_remaining is not None:
        progress = attrs.evolve(progress, completion_at=math.ceil(NOW + progress.seconds_remaining))
    left = total - done
    running = status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
    if not running or left == 0 or rate is None:
        expected = False
    elif rate > 0:
        expected = math.ceil(NOW + left / rate) > batch.expires_at
    else:  # nothing finished: at risk once it has waited longer than the time it has left
        expected = age > window_s - age
    assert will_miss(batch, progress, NOW) is expected


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _lines(count: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "2+2?"}]},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


def _at_risk_events(service: BatchService) -> list[dict[str, object]]:
    events = [json.loads(message.body) for message in service.metadata.due_webhooks(math.inf, 1000)]
    return [event for event in events if event["type"] == AT_RISK_EVENT]


@pytest.mark.anyio
async def test_a_batch_that_cannot_finish_in_time_is_at_risk_with_one_event_across_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = ServiceSettings(
        storage_path=tmp_path,
        max_pool_size=1,
        maintenance_interval_s=0.1,
        webhook_urls=("http://127.0.0.1:9/hooks",),
    )
    # 80 requests of 0.2 s on one slot: 16 s of work in an 8 s window
    async with BatchService(settings, load_backend("simulated", latency_s=0.2)) as service:
        late = await service.create_batch(
            (await service.create_file(_lines(80))).id, "/v1/chat/completions", completion_window="8s"
        )
        with anyio.fail_after(10):
            while not (seen := await service.get_batch(late.id)).at_risk:
                await anyio.sleep(0.05)
        assert seen.to_dict()["at_risk"] is True
        assert seen.progress.completion_at is not None and seen.progress.completion_at > seen.expires_at
        with anyio.fail_after(5):
            while not _at_risk_events(service):
                await anyio.sleep(0.05)
        assert service.batches_at_risk() == 1
        [said] = [
            r.getMessage() for r in caplog.records if "at risk of missing its deadline" in r.getMessage()
        ]
        ends = datetime.fromtimestamp(late.expires_at or 0, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        assert f"its completion window (8s) ends at {ends}, in " in said, said
        assert str(late.expires_at) not in said  # no raw Unix seconds
        await anyio.sleep(0.5)  # several more checks: still one event
        [event] = _at_risk_events(service)
        assert event["data"] == {"id": late.id}
        assert service.metadata.get_batch(late.id).at_risk_at is not None  # type: ignore[union-attr]
    async with BatchService(settings, load_backend("simulated", latency_s=0.2)) as service:
        with anyio.fail_after(10):
            while not (await service.get_batch(late.id)).at_risk:  # resumed, and at risk again
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)
        assert [event["id"] for event in _at_risk_events(service)] == [event["id"]]
        ended = await service.wait_for_batch(late.id)
        assert ended.status is BatchStatus.FAILED and not ended.at_risk
        assert len(_at_risk_events(service)) == 1


@pytest.mark.anyio
async def test_a_batch_with_time_to_spare_is_never_at_risk(tmp_path: Path) -> None:
    settings = ServiceSettings(
        storage_path=tmp_path,
        max_pool_size=2,
        maintenance_interval_s=0.1,
        webhook_urls=("http://127.0.0.1:9/h",),
    )
    async with BatchService(settings, load_backend("simulated", latency_s=0.05)) as service:
        batch = await service.create_batch(
            (await service.create_file(_lines(60))).id, "/v1/chat/completions", completion_window="1h"
        )
        while (seen := await service.get_batch(batch.id)).status is not BatchStatus.COMPLETED:
            assert not seen.at_risk and service.batches_at_risk() == 0
            await anyio.sleep(0.05)
        assert not _at_risk_events(service)
        assert service.metadata.get_batch(batch.id).at_risk_at is None  # type: ignore[union-attr]


def test_a_database_from_before_deadlines_opens_and_saves_the_at_risk_mark(tmp_path: Path) -> None:
    """A batches table without ``at_risk_at`` (an older version's) gains it; its rows read None."""
    path = tmp_path / "metadata.sqlite3"
    SQLiteMetadataStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE batches DROP COLUMN at_risk_at")
    store = SQLiteMetadataStore(path)
    try:
        old = _batch(10, 0, 3600, 0, BatchStatus.IN_PROGRESS)
        store.insert_batch(old)
        assert store.get_batch(old.id) == old and old.at_risk_at is None
        marked = attrs.evolve(old, at_risk_at=NOW)
        store.save_batch(marked)
        assert store.get_batch(old.id) == marked
    finally:
        store.close()


@given(
    moment=st.integers(0, 4_000_000_000),
    offset=st.integers(-10 * 86_400, 10 * 86_400),
)
def test_a_logged_time_reads_as_utc_and_as_the_distance_from_now(moment: int, offset: int) -> None:
    text = readable_time(moment + offset, moment)
    stamp, _, distance = text.partition(", ")
    assert (
        datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC).timestamp() == moment + offset
    )
    tokens = distance.removeprefix("in ").removesuffix(" ago").split() if offset else []
    units = {"h": 3600, "m": 60, "s": 1}
    assert sum(int(token[:-1]) * units[token[-1]] for token in tokens) == abs(offset)
    assert distance == "now" if offset == 0 else distance.startswith("in ") == (offset > 0)
    assert readable_time(None, moment) == "an unknown time"
