"""The Uploads API on two embedded replicas sharing one PostgreSQL and one folder (``shared_uploads``).

Two ``BatchService``s with ``ServiceSettings.shared``: an upload created on one takes parts sent
to either, at once, in any order, and completes on either to exactly the bytes of the order named
(Hypothesis), a byte order mark left out and a bad line named by its line number in the whole
file; an md5 that does not match stores nothing and leaves it pending. Both replicas completing
it at once make one file (the other answers with it, or a clear error). A complete cut short
after the file was assembled (a crash) serves nothing, and a complete on the other replica
finishes it into that same file. Cancel on the other replica deletes the parts and refuses more;
a cancel or an expiry there while a complete reads the parts makes that complete a clear 400, with
no file and no parts left; an upload's ``expires_after`` sets the lifetime of its file;
an upload left pending past its expiry is expired by maintenance and its parts deleted, and the
hourly clean-up deletes parts a cancel could not (the store unreachable) and forgets records ended
a week ago. A tenant's
``max_stored_bytes`` holds when parts and plain files arrive on both replicas at once: the bytes
recorded never pass it, and what is refused is a 413 ``quota_exceeded``.
"""

from __future__ import annotations

import hashlib
import random
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.clock import now
from batchgen.core.errors import BatchGenError, InvalidBatchFile, InvalidRequest, NotFound
from batchgen.core.execution.shared_storage import SharedStorage
from batchgen.core.files import shared_uploads
from batchgen.core.files.upload_rules import UploadQuotaExceeded
from batchgen.core.tenancy import EMBEDDED, Caller, TenantLimits
from tests.examples import examples
from tests.helpers import chat_line, jsonl

pytestmark = pytest.mark.live


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _settings(shared_folder: Path, root: Path, url: str, replica: str, **options: object) -> ServiceSettings:
    shared = SharedStorage(url, f"file://{shared_folder}", replica_id=replica, lease_s=3.0)
    return ServiceSettings(storage_path=root / replica, shared=shared, **options)  # type: ignore[arg-type]


@pytest.fixture
async def replicas(postgres_url: str, tmp_path: Path) -> AsyncIterator[list[BatchService]]:
    async with AsyncExitStack() as stack:
        services = []
        for replica in ("a", "b"):
            settings_ = _settings(
                tmp_path / "shared",
                tmp_path,
                postgres_url,
                replica,
                upload_expiry_s=3600,
                maintenance_interval_s=0.2,
            )
            services.append(await stack.enter_async_context(BatchService(settings_, SimulatedBackend())))
        yield services


async def _send(service: BatchService, upload_id: str, data: bytes, caller: Caller = EMBEDDED) -> str:
    destination = await service.new_upload_part(upload_id, caller=caller)
    with destination.open() as stream:
        stream.write(data)
    return (await service.add_upload_part(upload_id, destination, caller=caller)).id


async def _read(service: BatchService, file_id: str) -> bytes:
    content = await service.file_bytes(file_id)
    return b"".join([chunk async for chunk in await content.open(0, content.size)])


async def _create(service: BatchService, size: int, caller: Caller = EMBEDDED, purpose: str = "batch") -> str:
    upload = await service.create_upload(
        filename="big.jsonl", purpose=purpose, size=size, mime_type="text/jsonl", caller=caller
    )
    return upload.id


def _parts_folder(tmp_path: Path, upload_id: str) -> Path:
    return tmp_path / "shared" / "uploads" / upload_id


async def _uploaded_ids(service: BatchService) -> set[str]:
    files, _ = await service.list_files()
    return {file.id for file in files if file.purpose != "batch_output"}


async def _send_all(services: list[BatchService], upload_id: str, parts: list[bytes], seed: int) -> list[str]:
    """Send every part, each to a replica picked at random, all at once; their ids in order."""
    chooser = random.Random(seed)
    ids: list[str] = [""] * len(parts)

    async def one(index: int, service: BatchService) -> None:
        ids[index] = await _send(service, upload_id, parts[index])

    async with anyio.create_task_group() as tasks:
        for index in range(len(parts)):
            tasks.start_soon(one, index, chooser.choice(services))
    return ids


_EXAMPLES = settings(max_examples=examples(8), deadline=None, suppress_health_check=list(HealthCheck))


@_EXAMPLES
@given(
    groups=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    seed=st.integers(0, 2**32),
    bom=st.booleans(),
)
@pytest.mark.anyio
async def test_parts_sent_to_both_replicas_at_once_complete_on_either_to_the_order_named(
    replicas: list[BatchService], tmp_path: Path, groups: list[int], seed: int, bom: bool
) -> None:
    parts, count = [], 0
    for size in groups:
        parts.append(jsonl(*[chat_line(f"l{count + i}", "x" * (count + i)) for i in range(size)]))
        count += size
    if bom:
        parts[0] = b"\xef\xbb\xbf" + parts[0]
    upload_id = await _create(replicas[seed % 2], sum(map(len, parts)))
    ids = await _send_all(replicas, upload_id, parts, seed)
    order = list(range(len(parts))) if bom else random.Random(seed + 1).sample(range(len(parts)), len(parts))
    named = [ids[index] for index in order]
    raw = b"".join(parts[index] for index in order)
    finisher = replicas[(seed // 2) % 2]
    upload, file = await finisher.complete_upload(upload_id, named, md5=hashlib.md5(raw).hexdigest())
    assert upload.status == "completed" and file.line_count == count
    expected = raw.removeprefix(b"\xef\xbb\xbf")
    for service in replicas:  # a normal file on both
        assert await _read(service, file.id) == expected
        assert (await service.get_upload(upload_id)).status == "completed"
    assert not _parts_folder(tmp_path, upload_id).exists()  # the parts are deleted
    # again on the other replica: the same file (a retry after a lost answer)
    assert (await replicas[1 - (seed // 2) % 2].complete_upload(upload_id, named))[1].id == file.id


@pytest.mark.anyio
async def test_a_bad_line_across_parts_is_named_by_its_line_number_and_an_md5_mismatch_stores_nothing(
    replicas: list[BatchService],
) -> None:
    first, second = replicas
    lines: list[object] = [chat_line(f"b{i}") for i in range(30)]
    lines[17] = chat_line("b17", temperature=7)
    data = jsonl(*lines)
    upload_id = await _create(first, len(data))
    ids = [await _send(first, upload_id, data[:500]), await _send(second, upload_id, data[500:])]
    before = await _uploaded_ids(first)
    with pytest.raises(InvalidBatchFile, match="line 18: "):
        await second.complete_upload(upload_id, ids)
    assert (await first.get_upload(upload_id)).status == "pending"
    good = jsonl(*[chat_line(f"g{i}") for i in range(30)])
    upload_id = await _create(second, len(good))
    ids = [await _send(second, upload_id, good[:700]), await _send(first, upload_id, good[700:])]
    with pytest.raises(InvalidRequest) as mismatch:
        await first.complete_upload(upload_id, ids, md5=hashlib.md5(good + b"x").hexdigest())
    assert mismatch.value.code == "md5_mismatch"
    with pytest.raises(InvalidRequest) as short:
        await first.complete_upload(upload_id, ids[:1])
    assert short.value.param == "part_ids"
    assert await _uploaded_ids(second) == before  # nothing stored
    _, file = await first.complete_upload(upload_id, ids, md5=hashlib.md5(good).hexdigest())
    assert await _read(second, file.id) == good


async def _complete_into(
    answers: list[object], service: BatchService, upload_id: str, ids: list[str]
) -> None:
    """Complete the upload; its file's id, or the error (a clear one, never a crash), in ``answers``."""
    try:
        answers.append((await service.complete_upload(upload_id, ids))[1].id)
    except BatchGenError as refused:
        answers.append(refused)


@pytest.mark.anyio
async def test_both_replicas_completing_at_once_make_one_file(replicas: list[BatchService]) -> None:
    for round_ in range(4):
        data = jsonl(*[chat_line(f"c{round_}-{i}", "y" * i) for i in range(200)])
        upload_id = await _create(replicas[0], len(data))
        ids = await _send_all(replicas, upload_id, [data[:3000], data[3000:]], round_)
        before = await _uploaded_ids(replicas[0])
        answers: list[object] = []
        async with anyio.create_task_group() as tasks:
            for service in replicas:
                tasks.start_soon(_complete_into, answers, service, upload_id, ids)
        made = await _uploaded_ids(replicas[1]) - before
        assert len(made) == 1, answers
        (file_id,) = made
        assert file_id in answers and all(
            answer == file_id or isinstance(answer, InvalidRequest) for answer in answers
        )
        assert await _read(replicas[0], file_id) == data


@pytest.mark.anyio
async def test_a_complete_cut_short_serves_nothing_and_the_other_replica_finishes_it(
    replicas: list[BatchService], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = replicas
    data = jsonl(*[chat_line(f"k{i}") for i in range(50)])
    upload_id = await _create(first, len(data))
    ids = [await _send(second, upload_id, data[:1000]), await _send(first, upload_id, data[1000:])]
    before = await _uploaded_ids(first)
    crashed = first.parts.uploads
    assert isinstance(crashed, shared_uploads.SharedUploads)

    async def crash(*_args: object) -> None:
        raise RuntimeError("the replica died here")

    monkeypatch.setattr(crashed, "_record_file", crash)  # assembled and in place, not recorded
    with pytest.raises(RuntimeError):
        await first.complete_upload(upload_id, ids)
    completing = await second.parts.uploads.get(upload_id)
    assert completing.status == "completing" and completing.file_id is not None
    assert (await second.get_upload(upload_id)).to_dict()["status"] == "pending"
    for service in replicas:
        with pytest.raises(NotFound):
            await service.get_file(completing.file_id)
    with pytest.raises(InvalidRequest, match="another order"):
        await second.complete_upload(upload_id, ids[::-1])
    upload, file = await second.complete_upload(upload_id, ids)
    assert upload.status == "completed" and file.id == completing.file_id
    assert await _uploaded_ids(first) - before == {file.id}
    assert await _read(first, file.id) == data


@pytest.mark.anyio
async def test_cancel_on_the_other_replica_deletes_the_parts_and_refuses_more(
    replicas: list[BatchService], tmp_path: Path
) -> None:
    first, second = replicas
    upload_id = await _create(first, 100, purpose="user_data")
    part = await _send(second, upload_id, b"x" * 40)
    assert [path.name for path in _parts_folder(tmp_path, upload_id).iterdir()] == [part]
    assert (await second.cancel_upload(upload_id)).status == "cancelled"
    assert not _parts_folder(tmp_path, upload_id).exists()
    for service in replicas:
        assert (await service.get_upload(upload_id)).status == "cancelled"
        for attempt in (
            _send(service, upload_id, b"y"),
            service.complete_upload(upload_id, [part]),
            service.cancel_upload(upload_id),
        ):
            with pytest.raises(InvalidRequest) as refused:
                await attempt
            assert refused.value.code == "upload_cancelled"
    tenant = Caller("other")
    with pytest.raises(NotFound):
        await first.get_upload(upload_id, caller=tenant)
    with pytest.raises(NotFound):
        await first.get_upload("upload_nope")


@pytest.mark.anyio
async def test_an_upload_past_its_expiry_is_expired_by_maintenance(postgres_url: str, tmp_path: Path) -> None:
    settings_ = _settings(
        tmp_path / "shared", tmp_path, postgres_url, "a", upload_expiry_s=1, maintenance_interval_s=0.2
    )
    async with BatchService(settings_, SimulatedBackend()) as service:
        upload_id = await _create(service, 100, purpose="user_data")
        part = await _send(service, upload_id, b"z" * 30)
        with anyio.fail_after(15):
            while _parts_folder(tmp_path, upload_id).exists():  # the maintenance job, not a read
                await anyio.sleep(0.1)
        assert (await service.get_upload(upload_id)).status == "expired"
        with pytest.raises(InvalidRequest) as refused:
            await service.complete_upload(upload_id, [part])
        assert refused.value.code == "upload_expired"


async def _stored(service: BatchService, tenant: Caller) -> int:
    """The tenant's bytes as the quota counts them: files, and parts of pending uploads."""
    uploads = service.parts.uploads
    assert isinstance(uploads, shared_uploads.SharedUploads)
    return await service.parts.calls(uploads._records.stored_bytes, tenant.tenant)


@settings(max_examples=examples(6), deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(1, 400), min_size=2, max_size=16), limit=st.integers(300, 1500))
@pytest.mark.anyio
async def test_parts_and_files_on_both_replicas_at_once_never_pass_max_stored_bytes(
    replicas: list[BatchService], sizes: list[int], limit: int
) -> None:
    tenant = Caller(f"t{secrets.token_hex(6)}", limits=TenantLimits(max_stored_bytes=limit))
    room = Caller(tenant.tenant)  # the same tenant without the limit: for the uploads themselves
    # a part for an upload of its own each: nothing but the tenant's lock orders them
    upload_ids = [await _create(replicas[0], 1000, caller=room, purpose="user_data") for _ in sizes]
    accepted: list[int] = []
    refused: list[int] = []

    async def one(index: int, size: int) -> None:
        service = replicas[index % 2]
        try:
            if index % 3 == 2:  # a plain file (POST /v1/files)
                path = service.new_upload_path()
                path.write_bytes(b"q" * size)
                await service.add_file(path, filename="p.txt", purpose="user_data", caller=tenant)
            else:
                await _send(service, upload_ids[index], b"p" * size, caller=tenant)
            accepted.append(size)
        except UploadQuotaExceeded:
            refused.append(size)

    async with anyio.create_task_group() as tasks:
        for index, size in enumerate(sizes):
            tasks.start_soon(one, index, size)
    stored = await _stored(replicas[1], tenant)
    assert stored == sum(accepted) <= limit
    if sum(sizes) <= limit:
        assert not refused
    else:
        assert refused  # something had to be refused
    # cancelling frees the parts' bytes
    for upload_id in upload_ids:
        await replicas[1].cancel_upload(upload_id, caller=room)
    files, _ = await replicas[0].list_files(caller=tenant)
    assert await _stored(replicas[0], tenant) == sum(file.bytes for file in files)


@pytest.mark.anyio
async def test_parts_a_cancel_could_not_delete_are_deleted_later_and_old_records_forgotten(
    replicas: list[BatchService], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = replicas
    uploads = first.parts.uploads
    assert isinstance(uploads, shared_uploads.SharedUploads)
    upload_id = await _create(first, 100, purpose="user_data")
    await _send(second, upload_id, b"w" * 50)
    blobs = uploads._part_blobs

    def unreachable(_upload_id: str) -> None:
        raise OSError("the store is unreachable")

    monkeypatch.setattr(blobs, "delete_upload", unreachable)
    assert (await first.cancel_upload(upload_id)).status == "cancelled"  # the cancel holds
    assert _parts_folder(tmp_path, upload_id).exists()
    monkeypatch.undo()
    uploads._next_prune = 0  # the hourly clean-up, now: the parts go, the record stays a week
    await uploads.expire_pending()
    assert not _parts_folder(tmp_path, upload_id).exists()
    assert (await second.get_upload(upload_id)).status == "cancelled"
    monkeypatch.setattr(shared_uploads, "ENDED_RECORD_KEEP_S", 0)
    uploads._next_prune = 0
    await uploads.expire_pending()
    with pytest.raises(NotFound):
        await second.get_upload(upload_id)


@pytest.mark.parametrize("action", ["cancel", "expiry"])
@pytest.mark.anyio
async def test_an_upload_ended_on_the_other_replica_while_it_completes_is_a_clear_refusal(
    replicas: list[BatchService], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """The complete on one replica is paused while it reads the parts; the other cancels the
    upload, or expires it (its ``expires_at`` passed). The complete is refused with the upload's
    status (a 400), and nothing is left half made: no file, no parts."""
    first, second = replicas
    clock = [now()]
    monkeypatch.setattr(shared_uploads, "now", lambda: clock[0])
    data = jsonl(*[chat_line(f"e{i}") for i in range(30)])
    upload_id = await _create(first, len(data))
    ids = [await _send(first, upload_id, data[:500]), await _send(second, upload_id, data[500:])]
    before = await _uploaded_ids(first)
    reading, resume = threading.Event(), threading.Event()
    uploads = first.parts.uploads
    assert isinstance(uploads, shared_uploads.SharedUploads)
    read_part = uploads._part_blobs.chunks

    def paused_read(*args: Any) -> Iterator[bytes]:
        reading.set()
        if not resume.wait(60):
            raise TimeoutError("the test did not resume the complete")
        return read_part(*args)

    monkeypatch.setattr(uploads._part_blobs, "chunks", paused_read)
    answers: list[object] = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_complete_into, answers, first, upload_id, ids)
        with anyio.fail_after(60):
            await anyio.to_thread.run_sync(reading.wait)
        if action == "cancel":
            assert (await second.cancel_upload(upload_id)).status == "cancelled"
        else:
            clock[0] += 7200  # past expires_at: the other replica's read expires it
            assert (await second.get_upload(upload_id)).status == "expired"
        resume.set()
    (refused,) = answers
    assert isinstance(refused, InvalidRequest), refused
    status = "cancelled" if action == "cancel" else "expired"
    assert refused.code == f"upload_{status}"
    assert (await first.get_upload(upload_id)).status == status
    assert await _uploaded_ids(second) == before
    assert not _parts_folder(tmp_path, upload_id).exists()


@pytest.mark.anyio
async def test_an_uploads_expires_after_holds_for_the_file_made_on_the_other_replica(
    replicas: list[BatchService],
) -> None:
    first, second = replicas
    data = jsonl(*[chat_line(f"x{i}") for i in range(10)])
    upload = await first.create_upload(
        filename="a.jsonl", purpose="batch", size=len(data), mime_type="text/jsonl", expires_after_s=120
    )
    ids = [await _send(second, upload.id, data)]
    _, file = await second.complete_upload(upload.id, ids)
    assert file.expires_at == file.created_at + 120
    for seconds in (0, 30 * 86400 + 1):
        with pytest.raises(InvalidRequest, match="between 1 and"):
            await first.create_upload(
                filename="a.jsonl", purpose="batch", size=10, mime_type="text/jsonl", expires_after_s=seconds
            )
