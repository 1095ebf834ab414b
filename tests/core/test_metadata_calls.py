"""Metadata calls off the event loop: in place for SQLite, in worker threads for a store that blocks.

``MetadataCalls`` alone: where a call runs, how many run at once, and what ``one_at_a_time``
serialises. Then the embedded service over a store whose every call takes 0.1 s and says it
blocks (SQLite underneath, so the rules are the real ones): the API's file and batch calls (uploads
with an Idempotency-Key and their replays, reads, lists, content, usage, a batch's idempotent
replay, deleting a file, the Uploads API under a storage quota, the expiry job) make every
metadata call in a worker thread, and a heartbeat on the event
loop never stalls meanwhile. Over plain SQLite the same calls run in place, on the loop's thread,
as they always did.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.models import BatchStatus
from batchgen.core.storage import MetadataStore, SQLiteMetadataStore
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.tenancy import Caller, TenantLimits
from tests.helpers import chat_line, jsonl

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
#: What each call of the slow store takes: a call on the loop stalls it at least this long.
CALL_S = 0.15


class _Recorded:
    """A store (SQLite underneath) that records the thread of every call, and can be made slow."""

    def __init__(self, inner: MetadataStore, *, blocks: bool) -> None:
        self._inner = inner
        self.calls_block = blocks
        self.delay_s = 0.0
        self.calls: list[tuple[str, int]] = []
        #: Methods that fail as a disk that cannot be written would (EIO), while listed.
        self.failing: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.get_ident()))
            if self.delay_s:
                time.sleep(self.delay_s)
            if name in self.failing:
                raise OSError(errno.EIO, "Input/output error")
            return method(*args, **kwargs)

        return call


def _recording(*, blocks: bool) -> tuple[list[_Recorded], Callable[[Path], MetadataStore]]:
    """An ``open_metadata`` for the service that opens a ``_Recorded`` SQLite store, and the list
    the store it opened goes into."""
    recorded: list[_Recorded] = []

    def open_metadata(path: Path) -> MetadataStore:
        recorded.append(_Recorded(SQLiteMetadataStore(path), blocks=blocks))
        return recorded[-1]

    return recorded, open_metadata


def _lines(count: int) -> bytes:
    return jsonl(*(chat_line(f"r{i}", "hi") for i in range(count)))


class _Heartbeat:
    """A task on the event loop that ticks every 10 ms and remembers the longest gap."""

    def __init__(self) -> None:
        self.longest_gap_s = 0.0

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await anyio.sleep(0.01)
            moment = time.monotonic()
            self.longest_gap_s = max(self.longest_gap_s, moment - last)
            last = moment


async def _api_calls(service: BatchService, staging: Callable[[], Path], batch_id: str) -> None:
    """File and batch calls of the API that start no batch (a running batch's own saves are the
    tracker's, which stay in place for now)."""
    path = staging()
    path.write_bytes(_lines(3))
    first = await service.add_file(path, filename="a.jsonl", purpose="batch", idempotency_key="upload-1")
    path = staging()
    path.write_bytes(_lines(3))
    again = await service.add_file(path, filename="a.jsonl", purpose="batch", idempotency_key="upload-1")
    assert again.id == first.id
    assert (await service.get_file(first.id)).id == first.id
    assert first.id in [file.id for file in (await service.list_files())[0]]
    assert (await service.file_content(first.id))[1] == first.bytes
    batch = await service.get_batch(batch_id)
    assert batch.status is BatchStatus.COMPLETED
    assert [listed.id for listed in (await service.list_batches())[0]] == [batch_id]
    assert (await service.create_batch(batch.input_file_id, CHAT, idempotency_key="batch-1")).id == batch_id
    assert (await service.usage())[0].completed_requests == 4
    await service.delete_file(first.id)
    # the Uploads API, for a tenant with a storage quota (its stored bytes are read each time)
    tenant = Caller("quota", limits=TenantLimits(max_stored_bytes=1 << 30))
    content = _lines(2)
    upload = await service.create_upload(
        filename="b.jsonl", purpose="batch", size=len(content), mime_type="text/jsonl", caller=tenant
    )
    destination = await service.new_upload_part(upload.id, caller=tenant)
    with destination.open() as stream:
        stream.write(content)
    part = await service.add_upload_part(upload.id, destination, caller=tenant)
    _, made = await service.complete_upload(upload.id, [part.id], caller=tenant)
    assert (await service.get_file(made.id, caller=tenant)).bytes == len(content)


async def _run(tmp_path: Path, *, blocks: bool) -> tuple[list[tuple[str, int]], int, float]:
    """The calls the API made (method, thread), the loop's thread, and the loop's longest stall."""
    recorded, open_metadata = _recording(blocks=blocks)

    settings = ServiceSettings(storage_path=tmp_path, counters_flush_interval_s=0.05, max_pool_size=8)
    async with BatchService(settings, SimulatedBackend(), open_metadata=open_metadata) as service:
        file = await service.create_file(_lines(4))
        batch = await service.create_batch(file.id, CHAT, idempotency_key="batch-1")
        with anyio.fail_after(30):
            await service.wait_for_batch(batch.id)
            while batch.id in service.parts.tracker:  # its last save landed: nothing of it runs
                await anyio.sleep(0.01)
        store = recorded[0]
        store.calls.clear()
        store.delay_s = CALL_S
        heartbeat = _Heartbeat()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(heartbeat.run)
            await _api_calls(service, service.new_upload_path, batch.id)
            await service.expire_due()  # the maintenance job: nothing expired, but it looked
            tasks.cancel_scope.cancel()
        calls = list(store.calls)
        store.delay_s = 0.0
        return calls, threading.get_ident(), heartbeat.longest_gap_s


async def test_a_store_that_blocks_is_called_from_worker_threads_and_the_loop_never_waits(
    tmp_path: Path,
) -> None:
    calls, loop_thread, longest_gap_s = await _run(tmp_path, blocks=True)
    names = {name for name, _ in calls}
    assert {
        "get_idempotency_key",
        "insert_file",
        "get_file",
        "list_files",
        "get_batch",
        "list_batches",
    } <= names
    assert {"retries_of", "usage", "batches_using_file", "delete_file", "expired_files"} <= names
    on_loop = sorted({name for name, thread in calls if thread == loop_thread})
    assert on_loop == [], f"called on the event loop: {on_loop}"
    assert longest_gap_s < CALL_S * 0.8, f"the loop stalled {longest_gap_s:.3f} s"


async def test_sqlite_is_called_in_place_as_before(tmp_path: Path) -> None:
    calls, loop_thread, _ = await _run(tmp_path, blocks=False)
    assert calls and {thread for _, thread in calls} == {loop_thread}


async def test_batches_run_end_and_are_cancelled_with_no_store_call_on_the_loop(tmp_path: Path) -> None:
    """Whole batches over the store that blocks: every save of their lives (starts, counters,
    result-file records, ends with their webhook messages, a cancel, an ordered rewrite) is made in
    a worker thread (the threads are the exact check: the loop's own work on 400 lines can take
    longer than a call here, so no stall bound is asserted)."""
    recorded, open_metadata = _recording(blocks=True)

    settings = ServiceSettings(
        storage_path=tmp_path, counters_flush_interval_s=0.05, max_pool_size=4, error_file="openai"
    )
    backend = SimulatedBackend(latency_s=0.02, failure_rate=0.3)
    async with BatchService(settings, backend, open_metadata=open_metadata) as service:
        store = recorded[0]
        store.calls.clear()
        store.delay_s = 0.05
        file = await service.create_file(_lines(20))
        done = await service.create_batch(file.id, CHAT, output_order="input")
        ordered = await service.wait_for_batch(done.id)
        counts = ordered.request_counts
        assert ordered.status is BatchStatus.COMPLETED and counts.completed + counts.failed == 20
        assert ordered.output_file_id is not None
        if counts.failed:  # the error file's record was saved with the batch
            assert ordered.error_file_id is not None
            assert (await service.get_file(ordered.error_file_id)).bytes > 0
        long = await service.create_file(_lines(400))
        running = await service.create_batch(long.id, CHAT)
        with anyio.fail_after(30):
            while (await service.get_batch(running.id)).status is not BatchStatus.IN_PROGRESS:
                await anyio.sleep(0.01)
        # answered once saved: cancelling, or cancelled if the requests in flight ended meanwhile
        cancelled = await service.cancel_batch(running.id)
        assert cancelled.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED)
        assert (await service.wait_for_batch(running.id)).status is BatchStatus.CANCELLED
        while running.id in service.parts.tracker:
            await anyio.sleep(0.01)
        calls = list(store.calls)
        store.delay_s = 0.0
    names = {name for name, _ in calls}
    assert {"insert_batch", "save_batch", "insert_file"} <= names
    on_loop = sorted({name for name, thread in calls if thread == threading.get_ident()})
    assert on_loop == [], f"called on the event loop: {on_loop}"
    reopened = SQLiteMetadataStore(tmp_path / "metadata.sqlite3")  # what was saved
    try:
        for batch_id, status in ((done.id, BatchStatus.COMPLETED), (running.id, BatchStatus.CANCELLED)):
            saved = reopened.get_batch(batch_id)
            assert saved is not None and saved.status is status
    finally:
        reopened.close()


async def test_a_refused_save_off_the_loop_is_tried_again_and_nothing_is_lost(tmp_path: Path) -> None:
    """While the store refuses every batch save (an I/O error), a batch runs on, callers keep
    seeing its last saved status, the service reports the fault; once saves work again it ends
    saved, with every line once and its terminal webhook message in the outbox."""
    recorded, open_metadata = _recording(blocks=True)

    settings = ServiceSettings(
        storage_path=tmp_path,
        counters_flush_interval_s=0.05,
        max_pool_size=4,
        webhook_urls=("http://127.0.0.1:9/h",),
    )
    async with BatchService(
        settings, SimulatedBackend(latency_s=0.01), open_metadata=open_metadata
    ) as service:
        store = recorded[0]
        file = await service.create_file(_lines(60))
        store.failing = {"save_batch"}
        batch = await service.create_batch(file.id, CHAT)
        with anyio.fail_after(30):
            while not service.parts.tracker.unsaved():
                await anyio.sleep(0.01)
            active = service.parts.tracker.get(batch.id)
            assert active is not None
            while active.finished < 60 or not active.status.is_terminal:
                await anyio.sleep(0.01)
            await anyio.sleep(0.2)  # a few more refused tries
        # every line is written and the batch ended in memory; callers still see what was saved
        assert (await service.get_batch(batch.id)).status is BatchStatus.VALIDATING
        assert batch.id in service.parts.tracker.unsaved()
        assert store.pending_webhooks() == 0
        store.failing = set()
        with anyio.fail_after(30):
            done = await service.wait_for_batch(batch.id)
        assert done.status is BatchStatus.COMPLETED and done.request_counts.completed == 60
        assert done.output_file_id is not None
        path, size = await service.file_content(done.output_file_id)
        ids = [msgspec.json.decode(line)["custom_id"] for line in path.read_bytes()[:size].splitlines()]
        assert sorted(ids) == sorted(f"r{i}" for i in range(60))
        assert store.pending_webhooks() == 1


async def test_calls_in_threads_run_at_most_limit_at_once_and_in_place_ones_on_the_caller() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def slow() -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return threading.get_ident()

    class Blocking:
        calls_block = True

    threaded = MetadataCalls(Blocking(), limit=3)  # type: ignore[arg-type]
    threads: list[int] = []

    async def one() -> None:
        threads.append(await threaded(slow))

    async with anyio.create_task_group() as tasks:
        for _ in range(9):
            tasks.start_soon(one)
    assert most == 3 and threading.get_ident() not in threads
    in_place = MetadataCalls(object())  # type: ignore[arg-type]
    assert not in_place.in_threads and await in_place(threading.get_ident) == threading.get_ident()


async def test_one_at_a_time_serialises_sequences_in_threads() -> None:
    class Blocking:
        calls_block = True

    calls = MetadataCalls(Blocking())  # type: ignore[arg-type]
    inside, overlaps = 0, 0

    async def sequence() -> None:
        nonlocal inside, overlaps
        async with calls.one_at_a_time():
            inside += 1
            overlaps += inside > 1
            await calls(time.sleep, 0.02)
            inside -= 1

    async with anyio.create_task_group() as tasks:
        for _ in range(5):
            tasks.start_soon(sequence)
    assert overlaps == 0
