"""Storage faults injected at the storage protocols, through the embedded BatchService.

A ``MetadataStore`` wrapper raises the errors a broken disk gives (SQLite's "database or disk is
full", "disk I/O error", "attempt to write a readonly database"; ``OSError`` with ENOSPC or EIO)
on chosen calls. Each fault must stay where it happens: the call fails with ``StorageUnavailable``
and leaves nothing half made, a batch it meets waits instead of failing, a status callers saw
never changes, no background task dies, and the service recovers by itself once the fault is
gone. A crash of the scheduler loop stops the core visibly. The same on a real full filesystem:
``tests/server/test_storage_faults.py``.
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import StorageUnavailable
from batchgen.core.models import BatchStatus
from batchgen.core.storage import MetadataStore, SQLiteMetadataStore
from batchgen.core.storage.faults import storage_fault
from tests.database_lock import locked_elsewhere

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
DISK_FULL = sqlite3.OperationalError("database or disk is full")
IO_ERROR = sqlite3.OperationalError("disk I/O error")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FaultyMetadata:
    """The real SQLite store, raising ``faults[method]`` on calls to that method while set."""

    def __init__(self, path: Path) -> None:
        self.inner = SQLiteMetadataStore(path)
        self.faults: dict[str, BaseException] = {}

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if name in self.faults:
                raise self.faults[name]
            return method(*args, **kwargs)

        return call


def _service(tmp_path: Path, latency_s: float = 0.0) -> BatchService:
    """A service over the faulty store; ``service.metadata.faults`` sets the faults."""

    def open_metadata(path: Path) -> MetadataStore:
        return FaultyMetadata(path)

    settings = ServiceSettings(storage_path=tmp_path, counters_flush_interval_s=0.05, max_pool_size=4)
    return BatchService(settings, SimulatedBackend(latency_s=latency_s), open_metadata=open_metadata)


def _lines(count: int) -> bytes:
    return b"".join(
        msgspec.json.encode(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": CHAT,
                "body": {"messages": [{"role": "user", "content": "hi"}]},
            }
        )
        + b"\n"
        for i in range(count)
    )


async def _eventually(check: Callable[[], bool], timeout_s: float = 10) -> None:
    with anyio.fail_after(timeout_s):
        while not check():
            await anyio.sleep(0.02)


def test_storage_errors_are_told_from_other_errors() -> None:
    assert storage_fault(OSError(errno.ENOSPC, "No space left on device")).disk_full  # type: ignore[union-attr]
    assert not storage_fault(OSError(errno.EROFS, "Read-only file system")).disk_full  # type: ignore[union-attr]
    assert storage_fault(DISK_FULL).disk_full  # type: ignore[union-attr]
    for fault in (IO_ERROR, sqlite3.OperationalError("attempt to write a readonly database")):
        assert storage_fault(fault) is not None and not storage_fault(fault).disk_full  # type: ignore[union-attr]
    for other in (
        FileNotFoundError(errno.ENOENT, "gone"),
        sqlite3.OperationalError("no such table: x"),
        ValueError(),
    ):
        assert storage_fault(other) is None


async def test_a_create_that_cannot_be_saved_leaves_no_batch_and_works_again(tmp_path: Path) -> None:
    service = _service(tmp_path)
    async with service:
        store = service.metadata
        file = await service.create_file(_lines(3))
        store.faults["insert_batch"] = DISK_FULL  # type: ignore[attr-defined]
        with pytest.raises(StorageUnavailable) as raised:
            await service.create_batch(file.id, CHAT, idempotency_key="k1")
        assert raised.value.disk_full and "disk is full" in raised.value.message
        assert await service.list_batches() == ([], False)
        assert service.pool_status().active_batches == 0
        assert service.health().healthy
        del store.faults["insert_batch"]  # type: ignore[attr-defined]
        batch = await service.create_batch(file.id, CHAT, idempotency_key="k1")  # the key was not taken
        with anyio.fail_after(10):
            done = await service.wait_for_batch(batch.id)
        assert done.status is BatchStatus.COMPLETED and done.request_counts.completed == 3


async def test_an_upload_that_cannot_be_saved_leaves_no_row_and_no_blob(tmp_path: Path) -> None:
    service = _service(tmp_path)
    async with service:
        store = service.metadata
        store.faults["insert_file"] = OSError(errno.EIO, "Input/output error")  # type: ignore[attr-defined]
        with pytest.raises(StorageUnavailable) as raised:
            await service.create_file(_lines(2), filename="in.jsonl")
        assert not raised.value.disk_full and "Input/output error" in raised.value.message
        assert list((tmp_path / "files").iterdir()) == []
        assert list((tmp_path / "staging").iterdir()) == []
        assert await service.list_files() == ([], False)
        del store.faults["insert_file"]  # type: ignore[attr-defined]
        assert (await service.create_file(_lines(2))).line_count == 2


async def test_a_batch_whose_output_cannot_be_recorded_on_a_full_disk_runs_on_and_lands(
    tmp_path: Path,
) -> None:
    """The output file's record meets a full database: the batch is not failed. It runs on, callers
    keep seeing its last saved status, and the record and the status land once the store takes them."""
    service = _service(tmp_path, latency_s=0.05)
    async with service:
        store = service.metadata
        other = await service.create_batch((await service.create_file(_lines(40))).id, CHAT)
        await _eventually(
            lambda: (service.parts.tracker.get(other.id) or other).status is BatchStatus.IN_PROGRESS
        )
        hit_file = await service.create_file(_lines(5))
        store.faults["insert_file"] = DISK_FULL  # type: ignore[attr-defined]
        hit = await service.create_batch(hit_file.id, CHAT)
        active = service.parts.tracker.get(hit.id)
        assert active is not None
        await _eventually(lambda: active.finished == 5)
        assert active.status is not BatchStatus.FAILED
        seen = await service.get_batch(hit.id)
        assert seen.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS) and seen.error is None
        await _eventually(lambda: "disk is full" in (service.health().reason or ""))
        del store.faults["insert_file"]  # type: ignore[attr-defined]
        with anyio.fail_after(20):
            landed = await service.wait_for_batch(hit.id)
        assert landed.status is BatchStatus.COMPLETED and landed.request_counts.completed == 5
        assert landed.output_file_id is not None
        assert (await service.get_file(landed.output_file_id)).id == landed.output_file_id
        with anyio.fail_after(20):
            finished = await service.wait_for_batch(other.id)
        assert finished.status is BatchStatus.COMPLETED and finished.request_counts.completed == 40
        await _eventually(lambda: service.health().healthy)


async def test_a_status_the_store_refused_is_not_shown_and_lands_once_it_can(tmp_path: Path) -> None:
    """A batch ends while saves fail: callers keep seeing in_progress (never a status that a
    restart could take back), health names the failing flush, and both recover by themselves."""
    service = _service(tmp_path, latency_s=0.02)
    async with service:
        store = service.metadata
        batch = await service.create_batch((await service.create_file(_lines(20))).id, CHAT)
        await _eventually(
            lambda: (service.parts.tracker.get(batch.id) or batch).status is BatchStatus.IN_PROGRESS
        )
        store.faults["save_batch"] = IO_ERROR  # type: ignore[attr-defined]
        active = service.parts.tracker.get(batch.id)
        assert active is not None
        await _eventually(lambda: active.status is BatchStatus.COMPLETED)
        seen = await service.get_batch(batch.id)
        assert seen.status is BatchStatus.IN_PROGRESS and seen.request_counts.completed == 20
        await _eventually(lambda: not service.health().healthy)
        assert "flush counters" in (service.health().reason or "")
        assert "disk I/O error" in (service.health().reason or "")
        del store.faults["save_batch"]  # type: ignore[attr-defined]
        await _eventually(lambda: service.health().healthy)
        assert (await service.get_batch(batch.id)).status is BatchStatus.COMPLETED
        assert batch.id not in service.parts.tracker
    async with BatchService(ServiceSettings(storage_path=tmp_path), SimulatedBackend()) as again:
        assert (await again.get_batch(batch.id)).status is BatchStatus.COMPLETED


async def test_a_status_never_saved_is_never_shown_so_a_restart_changes_nothing_seen(tmp_path: Path) -> None:
    """The store refuses the final save until shutdown: the restart resumes the batch from the
    status callers saw, and it ends once, each request with one line."""
    service = _service(tmp_path, latency_s=0.02)
    async with service:
        store = service.metadata
        batch = await service.create_batch((await service.create_file(_lines(10))).id, CHAT)
        await _eventually(
            lambda: (service.parts.tracker.get(batch.id) or batch).status is BatchStatus.IN_PROGRESS
        )
        store.faults["save_batch"] = DISK_FULL  # type: ignore[attr-defined]
        active = service.parts.tracker.get(batch.id)
        assert active is not None
        await _eventually(lambda: active.status is BatchStatus.COMPLETED)
        assert (await service.get_batch(batch.id)).status is BatchStatus.IN_PROGRESS
    async with BatchService(ServiceSettings(storage_path=tmp_path), SimulatedBackend()) as again:
        with anyio.fail_after(10):
            done = await again.wait_for_batch(batch.id)
        assert done.status is BatchStatus.COMPLETED and done.request_counts.completed == 10
        output = tmp_path / "incremental" / f"{batch.id}.jsonl"
        ids = [msgspec.json.decode(line)["custom_id"] for line in output.read_bytes().splitlines()]
        assert sorted(ids) == sorted(f"r{i}" for i in range(10))


async def test_a_crashed_scheduler_stops_the_core_visibly(tmp_path: Path) -> None:
    service = _service(tmp_path)
    reasons: list[str] = []
    async with service:
        service.on_stop(reasons.append)

        def broken_admit(limit: int | None = None) -> list[Any]:
            raise RuntimeError("the scheduler broke")

        service.scheduler.admit = broken_admit  # type: ignore[method-assign]
        batch = await service.create_batch((await service.create_file(_lines(2))).id, CHAT)
        await _eventually(lambda: bool(reasons))
        assert "scheduler crashed: RuntimeError: the scheduler broke" in reasons[0]
        health = service.health()
        assert not health.healthy and "scheduler crashed" in (health.reason or "")
        assert (await service.get_batch(batch.id)).id == batch.id  # calls still answer


async def test_a_database_locked_by_another_process_refuses_writes_and_loses_nothing(tmp_path: Path) -> None:
    """Held locked by another connection: an upload, a create and a delete fail at once as
    StorageUnavailable (503 with Retry-After) leaving nothing behind, reads still answer, a running
    batch's saves wait; released, the same calls work and the batch ends as if nothing happened."""
    service = _service(tmp_path, latency_s=0.01)
    async with service:
        file = await service.create_file(_lines(3))
        running = await service.create_batch((await service.create_file(_lines(30))).id, CHAT)
        with locked_elsewhere(tmp_path / "metadata.sqlite3"):
            for call in (
                lambda: service.create_file(_lines(2)),
                lambda: service.create_batch(file.id, CHAT),
                lambda: service.delete_file(file.id),
            ):
                with pytest.raises(StorageUnavailable) as refused:
                    await call()
                assert refused.value.code == "storage_unavailable" and refused.value.retry_after_s >= 1
                assert "locked" in refused.value.message and not refused.value.disk_full
            assert (await service.get_file(file.id)).id == file.id
            assert len((await service.list_batches())[0]) == 1
            assert list((tmp_path / "staging").iterdir()) == []
            await anyio.sleep(0.3)  # the running batch goes on; its saves are refused meanwhile
        assert len((await service.list_files())[0]) == 2, "no upload was half made"
        again = await service.create_batch(file.id, CHAT)
        with anyio.fail_after(20):
            assert (await service.wait_for_batch(again.id)).status is BatchStatus.COMPLETED
            done = await service.wait_for_batch(running.id)
        assert done.status is BatchStatus.COMPLETED and done.request_counts.completed == 30
