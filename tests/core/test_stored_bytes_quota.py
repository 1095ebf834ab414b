"""A tenant's stored bytes in one process: admitted atomically, and counted as running totals.

Concurrent uploads (``asyncio.gather``) of a tenant whose ``max_stored_bytes`` fits only some of
them store exactly the ones that fit, whatever the sizes and the limit (Hypothesis). The Uploads
API's running totals (each upload's parts, bytes and log end; a tenant's pending bytes and open
uploads) equal a recount from disk after any sequence of parts added, parts dropped, completes and
cancels; and adding a part reads no other part's record.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, ServiceSettings, load_backend
from batchgen.core.errors import InvalidRequest
from batchgen.core.files.chunked_uploads import ChunkedUploads, _PartTally
from batchgen.core.files.upload_parts import PartFolder
from batchgen.core.files.upload_rules import UploadQuotaExceeded
from batchgen.core.models import OUTPUT_PURPOSE, PENDING
from batchgen.core.tenancy import Caller, TenantLimits

_tenants = itertools.count()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BlockingPortal, BatchService]]:
    """One embedded service, run by a portal's event loop, for every example of the module."""
    service = BatchService(
        ServiceSettings(storage_path=tmp_path_factory.mktemp("quota")), load_backend("simulated")
    )
    with start_blocking_portal("asyncio") as portal, portal.wrap_async_context_manager(service):
        yield portal, service


def _tenant(limit: int | None) -> Caller:
    """A caller of a tenant no example used before, with ``limit`` as its ``max_stored_bytes``."""
    return Caller(f"tenant-{next(_tenants)}", limits=TenantLimits(max_stored_bytes=limit))


def _batch_file(lines: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "default", "messages": [{"role": "user", "content": "q" * i}]},
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )


async def _files_bytes(service: BatchService, tenant: str) -> int:
    files, _ = await service.list_files(caller=Caller(tenant))
    return sum(file.bytes for file in files if file.purpose != OUTPUT_PURPOSE)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.integers(1, 40), min_size=2, max_size=8), room=st.integers(0, 8000))
def test_concurrent_uploads_store_exactly_the_ones_that_fit(
    running: tuple[BlockingPortal, BatchService], lines: list[int], room: int
) -> None:
    portal, service = running
    caller = _tenant(room)
    contents = [_batch_file(count) for count in lines]

    async def scenario() -> tuple[list[int], list[int], int]:
        stored: list[int] = []
        refused: list[int] = []

        async def send(content: bytes) -> None:
            staging = service.new_upload_path()
            staging.write_bytes(content)
            try:
                file = await service.add_file(staging, filename="in.jsonl", purpose="batch", caller=caller)
            except UploadQuotaExceeded:
                refused.append(len(content))
            else:
                stored.append(file.bytes)

        async with anyio.create_task_group() as tasks:
            for content in contents:
                tasks.start_soon(send, content)
        return stored, refused, await _files_bytes(service, caller.tenant)

    stored, refused, on_record = portal.call(scenario)
    assert on_record == sum(stored) <= room
    assert len(stored) + len(refused) == len(contents)
    # no bytes were given back (every file is valid): a refused file did not fit beside those stored
    assert all(sum(stored) + size > room for size in refused)
    assert service.parts.files.quota.pending_bytes(caller.tenant) == 0
    assert portal.call(service.parts.files.quota.used, caller.tenant) == sum(stored)


def _chunked(service: BatchService) -> ChunkedUploads:
    uploads = service.parts.uploads
    assert isinstance(uploads, ChunkedUploads)
    return uploads


def _recount(service: BatchService, tenant: str) -> tuple[dict[str, _PartTally], int, int]:
    """Each pending upload of ``tenant`` counted from disk; the bytes of their parts; how many."""
    uploads = _chunked(service)
    pending = [upload for upload in uploads.uploads() if upload.owner == tenant and upload.status == PENDING]
    tallies = {
        upload.id: _PartTally.counted(tenant, PartFolder(uploads.root / upload.id)) for upload in pending
    }
    return tallies, sum(tally.bytes for tally in tallies.values()), len(pending)


_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("create"), st.integers(1, 6)),
        st.tuples(st.just("part"), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("drop"), st.integers(0, 3)),
        st.tuples(st.just("complete"), st.integers(0, 3)),
        st.tuples(st.just("cancel"), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=_OPERATIONS, limit=st.one_of(st.none(), st.integers(5, 30)))
def test_running_totals_equal_a_recount_after_any_sequence(
    running: tuple[BlockingPortal, BatchService], operations: list[tuple[Any, ...]], limit: int | None
) -> None:
    portal, service = running
    caller = _tenant(limit)
    uploads = _chunked(service)
    quota = service.parts.files.quota
    created: list[str] = []
    parts: dict[str, list[str]] = {}

    async def apply(operation: tuple[Any, ...]) -> None:
        kind = operation[0]
        if kind == "create":
            upload = await service.create_upload(
                filename="a.bin",
                purpose="user_data",
                size=operation[1],
                mime_type="text/plain",
                caller=caller,
            )
            created.append(upload.id)
            parts[upload.id] = []
            return
        if not created:
            return
        upload_id = created[operation[1] % len(created)]
        if kind in ("part", "drop"):
            destination = await service.new_upload_part(upload_id, caller=caller)
            with destination.open() as stream:
                stream.write(b"x" * (operation[2] if kind == "part" else 1))
            if kind == "drop":
                service.drop_upload_part(upload_id, destination)
                return
            part = await service.add_upload_part(upload_id, destination, caller=caller)
            parts[upload_id].append(part.id)
        elif kind == "complete":
            await service.complete_upload(upload_id, parts[upload_id], caller=caller)
        else:
            await service.cancel_upload(upload_id, caller=caller)

    for operation in operations:
        # refused (not pending, no room, over the limit, parts not adding up): nothing changes
        with contextlib.suppress(InvalidRequest, UploadQuotaExceeded):
            portal.call(apply, operation)
        tallies, pending_bytes, pending = _recount(service, caller.tenant)
        assert {upload_id: uploads._tallies[upload_id] for upload_id in tallies} == tallies
        assert set(uploads._tallies) >= set(tallies)
        assert quota.pending_bytes(caller.tenant) == pending_bytes
        assert uploads.open_uploads(caller.tenant) == pending
        used = portal.call(quota.used, caller.tenant)
        assert used == pending_bytes + portal.call(_files_bytes, service, caller.tenant)
        if limit is not None:
            assert used <= limit


def test_adding_a_part_reads_no_part_records(
    running: tuple[BlockingPortal, BatchService], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part's cost does not grow with the parts received before it, of its upload or of the
    tenant's others: adding one reads no upload's parts back from disk."""
    portal, service = running
    caller = _tenant(10_000)

    async def add(upload_id: str) -> None:
        destination = await service.new_upload_part(upload_id, caller=caller)
        with destination.open() as stream:
            stream.write(b"y")
        await service.add_upload_part(upload_id, destination, caller=caller)

    async def create() -> str:
        upload = await service.create_upload(
            filename="a.bin", purpose="user_data", size=100, mime_type="text/plain", caller=caller
        )
        return upload.id

    upload_ids = [portal.call(create) for _ in range(3)]
    for upload_id in upload_ids:
        for _ in range(5):
            portal.call(add, upload_id)
    reads: list[str] = []
    for name in ("parts", "log_parts"):
        original = getattr(PartFolder, name)

        def counted(folder: PartFolder, _original: Any = original, _name: str = name) -> Any:
            reads.append(f"{_name}({folder.folder.name})")
            return _original(folder)

        monkeypatch.setattr(PartFolder, name, counted)
    portal.call(add, upload_ids[0])
    assert reads == []
    monkeypatch.undo()
    assert len(_chunked(service).parts(upload_ids[0])) == 6
    assert service.parts.files.quota.pending_bytes(caller.tenant) == 16
