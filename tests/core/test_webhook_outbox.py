"""The webhook outbox: one event per terminal status, saved in the same write as that status.

Delivery itself (HTTP, signatures, retries against a real receiver) is tested in
``tests/server/test_webhooks.py``; here the service and the store are driven directly.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import InvalidRequest
from batchgen.core.models import Batch, BatchParameters, BatchStatus, RequestCounts
from batchgen.core.storage import MetadataStore, SQLiteMetadataStore
from batchgen.core.webhook_outbox import (
    EVENT_TYPES,
    MAX_RETRY_DELAY_S,
    WebhookTargets,
    check_webhook_url,
    retry_delay_s,
)
from tests.core.test_storage_faults import DISK_FULL, FaultyMetadata

CHAT = "/v1/chat/completions"
HOOK = "http://127.0.0.1:9/hook"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _lines(count: int) -> bytes:
    line = {"method": "POST", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}]}}
    return b"".join(msgspec.json.encode({"custom_id": f"r{i}", **line}) + b"\n" for i in range(count))


def _batch(batch_id: str, status: BatchStatus) -> Batch:
    return Batch(
        id=batch_id,
        endpoint=CHAT,
        input_file_id="file-in",
        completion_window="24h",
        status=status,
        created_at=1000,
        expires_at=2000,
        model="m",
        parameters=BatchParameters(),
        request_counts=RequestCounts(total=3),
    )


def _events(store: MetadataStore) -> list[dict[str, object]]:
    return [json.loads(message.body) for message in store.due_webhooks(float("inf"), 1000)]


@given(attempts=st.integers(1, 80), initial=st.floats(0.001, 1000), seed=st.integers(0, 2**32))
def test_retry_delays_double_with_jitter_up_to_the_cap(attempts: int, initial: float, seed: int) -> None:
    import random

    base = min(MAX_RETRY_DELAY_S, initial * 2 ** (attempts - 1))
    delay = retry_delay_s(attempts, initial, random.Random(seed))
    assert 0.5 * base <= delay < 1.5 * base
    assert delay < 1.5 * MAX_RETRY_DELAY_S


@pytest.mark.parametrize(
    "url",
    ["ftp://x/hook", "/relative", "http://", "http://host:port/", "http://a b/", 7, "http://x/" + "a" * 3000],
)
def test_unusable_urls_are_refused(url: object) -> None:
    with pytest.raises(InvalidRequest):
        check_webhook_url(url)


def test_each_terminal_status_makes_one_event_per_url() -> None:
    targets = WebhookTargets(("http://a/hook", "https://b:8443/hook"))
    for status in BatchStatus:
        messages = targets.messages(_batch("batch_1", status), 1234)
        if status not in EVENT_TYPES:
            assert messages == ()
            continue
        assert [message.target for message in messages] == ["http://a/hook", "https://b:8443/hook"]
        [event_id] = {message.event_id for message in messages}
        [body] = {message.body for message in messages}
        assert json.loads(body) == {
            "id": event_id,
            "object": "event",
            "type": EVENT_TYPES[status],
            "created_at": 1234,
            "data": {"id": "batch_1"},
        }
    assert WebhookTargets().messages(_batch("batch_1", BatchStatus.COMPLETED), 1) == ()


def test_the_outbox_is_saved_with_the_status_or_not_at_all(tmp_path: Path) -> None:
    store = SQLiteMetadataStore(tmp_path / "metadata.sqlite3")
    store.insert_batch(_batch("batch_1", BatchStatus.IN_PROGRESS))
    ended = _batch("batch_1", BatchStatus.COMPLETED)
    messages = WebhookTargets((HOOK,)).messages(ended, 1000)
    with sqlite3.connect(tmp_path / "metadata.sqlite3") as db:  # the disk fails on the outbox write
        db.execute(
            "CREATE TRIGGER failing BEFORE INSERT ON webhook_outbox BEGIN SELECT RAISE(ABORT, 'disk I/O error'); END"
        )
    with pytest.raises(sqlite3.Error):
        store.save_batch(ended, outbox=messages)
    assert store.get_batch("batch_1").status is BatchStatus.IN_PROGRESS  # type: ignore[union-attr]
    assert store.pending_webhooks() == 0
    with sqlite3.connect(tmp_path / "metadata.sqlite3") as db:
        db.execute("DROP TRIGGER failing")
    store.save_batch(ended, outbox=messages)
    assert store.get_batch("batch_1").status is BatchStatus.COMPLETED  # type: ignore[union-attr]
    assert store.due_webhooks(2000, 10) == list(messages)
    store.close()


@pytest.mark.anyio
async def test_a_finished_batch_leaves_exactly_one_event_even_when_its_final_save_failed(
    tmp_path: Path,
) -> None:
    """The store refuses the terminal save for a while: no event until the status lands, then one."""
    settings = ServiceSettings(
        storage_path=tmp_path, counters_flush_interval_s=0.05, max_pool_size=2, webhook_urls=(HOOK,)
    )
    service = BatchService(settings, SimulatedBackend(latency_s=0.02), open_metadata=FaultyMetadata)
    async with service:
        store = service.metadata
        batch = await service.create_batch((await service.create_file(_lines(10))).id, CHAT)
        with anyio.fail_after(10):
            while (service.parts.tracker.get(batch.id) or batch).status is not BatchStatus.IN_PROGRESS:
                await anyio.sleep(0.01)
        store.faults["save_batch"] = DISK_FULL  # type: ignore[attr-defined]
        active = service.parts.tracker.get(batch.id)
        assert active is not None
        with anyio.fail_after(10):
            while active.status is not BatchStatus.COMPLETED:
                await anyio.sleep(0.01)
        assert store.pending_webhooks() == 0, "no event before its status is saved"
        del store.faults["save_batch"]  # type: ignore[attr-defined]
        done = await service.wait_for_batch(batch.id)
        events = _events(store)
    assert done.status is BatchStatus.COMPLETED
    assert [(event["type"], event["data"]) for event in events] == [("batch.completed", {"id": batch.id})]


@pytest.mark.anyio
async def test_a_batch_cancelling_at_a_crash_sends_its_cancelled_event_on_restart(tmp_path: Path) -> None:
    store = SQLiteMetadataStore(tmp_path / "metadata.sqlite3")
    store.insert_batch(_batch("batch_c", BatchStatus.CANCELLING))
    store.close()
    settings = ServiceSettings(storage_path=tmp_path, webhook_urls=(HOOK,))
    async with BatchService(settings, SimulatedBackend()) as service:
        assert (await service.get_batch("batch_c")).status is BatchStatus.CANCELLED
        events = _events(service.metadata)
    assert [(event["type"], event["data"]) for event in events] == [("batch.cancelled", {"id": "batch_c"})]


@pytest.mark.anyio
async def test_a_batch_url_is_checked_only_where_it_is_honoured(tmp_path: Path) -> None:
    allowing = ServiceSettings(storage_path=tmp_path / "a", webhook_batch_urls=True)
    async with BatchService(allowing, SimulatedBackend()) as service:
        file_id = (await service.create_file(_lines(1))).id
        with pytest.raises(InvalidRequest) as refused:
            await service.create_batch(file_id, CHAT, metadata={"webhook_url": "not a url"})
        assert refused.value.param == "metadata.webhook_url"
        batch = await service.create_batch(file_id, CHAT, metadata={"webhook_url": "https://h.example/x"})
        await service.wait_for_batch(batch.id)
        assert [message.target for message in service.metadata.due_webhooks(float("inf"), 10)] == [
            "https://h.example/x"
        ]
    plain = ServiceSettings(storage_path=tmp_path / "p")
    async with BatchService(plain, SimulatedBackend()) as service:
        file_id = (await service.create_file(_lines(1))).id
        batch = await service.create_batch(file_id, CHAT, metadata={"webhook_url": "not a url"})
        await service.wait_for_batch(batch.id)
        assert service.metadata.pending_webhooks() == 0, "no URL configured: no event"
