"""The storage contract: what every MetadataStore, BlobStore and ResultWriter must do.

Each test takes a ``storage`` fixture parametrised over the implementations: SQLite with the
local filesystem; a real PostgreSQL (a database of its own per test, ``postgres_url``) with the
local filesystem, the metadata several servers share over a folder they all mount; and PostgreSQL
with a real S3 server (SeaweedFS, a prefix of its own per test), where each replica keeps its own
copies of the files it reads. ``open_replica_blobs`` opens another view of the same blobs. A new
implementation is added to ``IMPLEMENTATIONS`` and is done when this module passes for it unchanged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.errors import InvalidRequest, StorageUnavailable
from batchgen.core.ids import new_object_id
from batchgen.core.models import (
    Batch,
    BatchErrorInfo,
    BatchParameters,
    BatchStatus,
    FileObject,
    RequestCounts,
    Usage,
)
from batchgen.core.storage import (
    BlobStore,
    LocalBlobStore,
    MetadataStore,
    ResultWriter,
    SQLiteMetadataStore,
)
from batchgen.core.storage.faults import storage_fault
from batchgen.core.webhook_outbox import OutboxMessage
from tests.database_lock import locked_elsewhere, postgres_locked_elsewhere
from tests.examples import examples
from tests.seaweedfs import SeaweedServer


@attrs.define
class Storage:
    """One implementation: how to open its stores over a folder (again, to test persistence), and
    how another process takes the metadata's write lock and holds it (for as long as the context)."""

    open_metadata: Callable[[], MetadataStore]
    open_blobs: Callable[[], BlobStore]
    lock_elsewhere: Callable[[], AbstractContextManager[object]]
    #: Another view of the same blobs: another replica's (the same object store with a storage
    #: folder of its own), or the same folder opened again (one process, or a shared mount).
    open_replica_blobs: Callable[[], BlobStore]


def _sqlite_local(request: pytest.FixtureRequest, root: Path) -> Storage:
    return Storage(
        open_metadata=lambda: SQLiteMetadataStore(root / "metadata.sqlite3"),
        open_blobs=lambda: LocalBlobStore(root),
        lock_elsewhere=lambda: locked_elsewhere(root / "metadata.sqlite3"),
        open_replica_blobs=lambda: LocalBlobStore(root),
    )


def _postgres_local(request: pytest.FixtureRequest, root: Path) -> Storage:
    from batchgen.core.storage.postgres_metadata import PostgresMetadataStore

    url: str = request.getfixturevalue("postgres_url")
    return Storage(
        open_metadata=lambda: PostgresMetadataStore(url),
        open_blobs=lambda: LocalBlobStore(root),
        lock_elsewhere=lambda: postgres_locked_elsewhere(url),
        open_replica_blobs=lambda: LocalBlobStore(root),
    )


def _postgres_s3(request: pytest.FixtureRequest, root: Path) -> Storage:
    from batchgen.core.storage.object_blobs import ObjectBlobStore
    from batchgen.core.storage.postgres_metadata import PostgresMetadataStore

    url: str = request.getfixturevalue("postgres_url")
    seaweed: SeaweedServer = request.getfixturevalue("seaweed_server")
    blob_url = seaweed.url(f"contract-{time.time_ns()}")
    return Storage(
        open_metadata=lambda: PostgresMetadataStore(url),
        open_blobs=lambda: ObjectBlobStore.from_url(blob_url, root, seaweed.environ),
        lock_elsewhere=lambda: postgres_locked_elsewhere(url),
        open_replica_blobs=lambda: ObjectBlobStore.from_url(blob_url, root / "replica", seaweed.environ),
    )


IMPLEMENTATIONS: dict[str, Callable[[pytest.FixtureRequest, Path], Storage]] = {
    "sqlite+local": _sqlite_local,
    "postgres+local": _postgres_local,
    "postgres+s3": _postgres_s3,
}
#: Implementations that start a server of their own (so their tests are ``live``).
_LIVE = frozenset({"postgres+local", "postgres+s3"})


@pytest.fixture(
    params=[
        pytest.param(name, marks=[pytest.mark.live] if name in _LIVE else [])
        for name in sorted(IMPLEMENTATIONS)
    ]
)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return IMPLEMENTATIONS[request.param](request, tmp_path)


@pytest.fixture
def metadata(storage: Storage) -> Iterator[MetadataStore]:
    store = storage.open_metadata()
    yield store
    store.close()


def _file(file_id: str, *, purpose: str = "batch", expires_at: int | None = None) -> FileObject:
    return FileObject(
        id=file_id,
        bytes=10,
        created_at=1000,
        filename=f"{file_id}.jsonl",
        purpose=purpose,
        path=f"/data/{file_id}.jsonl",
        line_count=3,
        url="/v1/chat/completions",
        expires_at=expires_at,
    )


def _batch(
    batch_id: str, input_file_id: str = "file-in", status: BatchStatus = BatchStatus.VALIDATING
) -> Batch:
    return Batch(
        id=batch_id,
        endpoint="/v1/chat/completions",
        input_file_id=input_file_id,
        completion_window="24h",
        status=status,
        created_at=1000,
        expires_at=2000,
        model="m",
        parameters=BatchParameters(max_decoding_length=5, temperature=0.5, top_p=0.9, top_k=4),
        metadata={"k": "v"},
        request_counts=RequestCounts(total=3),
    )


def test_implementations_satisfy_the_protocols(storage: Storage, metadata: MetadataStore) -> None:
    blobs = storage.open_blobs()
    assert isinstance(metadata, MetadataStore)
    assert isinstance(blobs, BlobStore)
    assert isinstance(blobs.open_result_writer(blobs.output_path("batch_a")), ResultWriter)


# --- metadata: files ---------------------------------------------------------------------------
def test_a_file_round_trips_and_survives_reopening(storage: Storage) -> None:
    store = storage.open_metadata()
    file = _file("file-a", expires_at=5000)
    store.insert_file(file)
    assert store.get_file("file-a") == file
    store.close()
    reopened = storage.open_metadata()
    assert reopened.get_file("file-a") == file
    assert reopened.get_file("file-missing") is None
    reopened.close()


def test_inserting_a_file_id_twice_is_refused(metadata: MetadataStore) -> None:
    metadata.insert_file(_file("file-a"))
    with pytest.raises(Exception):  # noqa: B017 - each implementation raises its own integrity error
        metadata.insert_file(_file("file-a"))


def test_deleting_a_file_forgets_it_and_unknown_ids_are_harmless(metadata: MetadataStore) -> None:
    metadata.insert_file(_file("file-a"))
    metadata.delete_file("file-a")
    metadata.delete_file("file-never")
    assert metadata.get_file("file-a") is None
    assert metadata.list_files(after=None, limit=10, descending=True, purpose=None) == ([], False)


def test_expired_files_are_those_due_oldest_first(metadata: MetadataStore) -> None:
    metadata.insert_file(_file("file-late", expires_at=300))
    metadata.insert_file(_file("file-never"))
    metadata.insert_file(_file("file-early", expires_at=100))
    metadata.insert_file(_file("file-now", expires_at=200))
    assert [f.id for f in metadata.expired_files(200)] == ["file-early", "file-now"]
    assert metadata.expired_files(99) == []


@settings(max_examples=examples(25), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(0, 25), limit=st.integers(1, 7), descending=st.booleans())
def test_file_pages_cover_every_file_once_in_creation_order(
    storage: Storage, count: int, limit: int, descending: bool
) -> None:
    store = storage.open_metadata()
    try:
        prefix = f"file-{count}-{limit}-{int(descending)}-"
        ids = [f"{prefix}{i:03d}" for i in range(count)]
        for i, file_id in enumerate(ids):
            store.insert_file(_file(file_id, purpose="batch" if i % 3 else "batch_output"))
        expected = list(reversed(ids)) if descending else ids
        seen: list[str] = []
        after = None
        while True:
            page, has_more = store.list_files(after=after, limit=limit, descending=descending, purpose=None)
            seen += [f.id for f in page if f.id.startswith(prefix)]
            assert len(page) <= limit
            if not has_more:
                break
            after = page[-1].id
        assert seen == expected
        outputs, _ = store.list_files(after=None, limit=1000, descending=False, purpose="batch_output")
        assert [f.id for f in outputs if f.id.startswith(prefix)] == [
            file_id for i, file_id in enumerate(ids) if i % 3 == 0
        ]
    finally:
        for file_id in ids:
            store.delete_file(file_id)
        store.close()


# --- metadata: idempotency keys ----------------------------------------------------------------
def test_idempotency_keys_are_recorded_once(metadata: MetadataStore) -> None:
    assert metadata.get_idempotency_key("k") is None
    metadata.put_idempotency_key("k", "batch", "fp", "batch_a", 1000)
    assert metadata.get_idempotency_key("k") == ("batch", "fp", "batch_a")
    with pytest.raises(Exception):  # noqa: B017 - each implementation raises its own integrity error
        metadata.put_idempotency_key("k", "file", "other", "file-b", 1001)
    assert metadata.get_idempotency_key("k") == ("batch", "fp", "batch_a")


def test_a_forgotten_idempotency_key_can_be_recorded_again(metadata: MetadataStore) -> None:
    metadata.put_idempotency_key("k", "file", "fp", "file-a", 1000)
    metadata.delete_idempotency_key("k")
    metadata.delete_idempotency_key("never-recorded")
    assert metadata.get_idempotency_key("k") is None
    metadata.put_idempotency_key("k", "file", "fp", "file-b", 1001)
    assert metadata.get_idempotency_key("k") == ("file", "fp", "file-b")


# --- metadata: batches -------------------------------------------------------------------------
def test_a_batch_round_trips_with_every_field(storage: Storage) -> None:
    store = storage.open_metadata()
    batch = _batch("batch_a")
    store.insert_batch(batch)
    assert store.get_batch("batch_a") == batch
    saved = attrs.evolve(
        batch,
        status=BatchStatus.FAILED,
        output_file_id="file-out",
        error_file_id="file-err",
        request_counts=RequestCounts(3, 1, 1),
        error=BatchErrorInfo("batch_failed", "disk full"),
        in_progress_at=1001,
        failed_at=1002,
    )
    store.save_batch(saved)
    store.close()
    reopened = storage.open_metadata()
    assert reopened.get_batch("batch_a") == saved
    assert reopened.get_batch("batch_missing") is None
    reopened.close()


def test_active_batches_are_the_unfinished_ones_oldest_first(metadata: MetadataStore) -> None:
    for i, status in enumerate(BatchStatus):
        metadata.insert_batch(_batch(f"batch_{i}", status=status))
    active = metadata.active_batches()
    assert [b.status for b in active] == [s for s in BatchStatus if s.is_active]
    assert [b.id for b in active] == sorted(b.id for b in active)


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.integers(1, 30),
    limit=st.integers(1, 6),
    descending=st.booleans(),
    deletions=st.lists(st.lists(st.integers(0, 29), max_size=6), max_size=12),
    data=st.data(),
)
def test_paging_while_files_are_deleted_yields_every_survivor_once(
    storage: Storage,
    count: int,
    limit: int,
    descending: bool,
    deletions: list[list[int]],
    data: st.DataObject,
) -> None:
    """Between pages, any files are deleted (the cursor's own file too): the pages still end with
    every file never deleted, each once, in creation order, and never repeat one."""
    store = storage.open_metadata()
    ids = [f"file-{i:03d}" for i in range(count)]
    try:
        for file_id in ids:
            store.insert_file(_file(file_id))
        deleted: set[str] = set()
        seen: list[str] = []
        after = None
        for page_number in range(count + 1):
            page, has_more = store.list_files(after=after, limit=limit, descending=descending, purpose=None)
            seen += [f.id for f in page]
            if not has_more:
                break
            after = page[-1].id
            if data.draw(st.booleans(), label="delete the cursor's file"):
                deleted.add(after)
                store.delete_file(after)
            for index in deletions[page_number] if page_number < len(deletions) else []:
                if index < count:
                    deleted.add(ids[index])
                    store.delete_file(ids[index])
        survivors = [file_id for file_id in ids if file_id not in deleted]
        assert len(seen) == len(set(seen))
        assert seen == sorted(seen, reverse=descending)
        assert set(survivors) <= set(seen)
    finally:
        for file_id in ids:
            store.delete_file(file_id)
        store.close()


def test_a_cursor_naming_no_object_ever_stored_is_refused(metadata: MetadataStore) -> None:
    metadata.insert_file(_file("file-a"))
    metadata.insert_batch(_batch("batch_a"))
    with pytest.raises(InvalidRequest) as refused:
        metadata.list_files(after="file-never", limit=10, descending=True, purpose=None)
    assert refused.value.param == "after"
    with pytest.raises(InvalidRequest):
        metadata.list_batches(after="batch_never", limit=10)


def test_a_deleted_files_number_is_not_given_again(metadata: MetadataStore) -> None:
    metadata.insert_file(_file("file-a"))
    metadata.insert_file(_file("file-b"))
    metadata.delete_file("file-b")  # the newest: a store numbering by max(live) would reuse its number
    metadata.insert_file(_file("file-c"))
    page, _ = metadata.list_files(after="file-b", limit=10, descending=False, purpose=None)
    assert [f.id for f in page] == ["file-c"]
    page, _ = metadata.list_files(after="file-b", limit=10, descending=True, purpose=None)
    assert [f.id for f in page] == ["file-a"]


def test_batch_pages_go_either_way(metadata: MetadataStore) -> None:
    ids = [f"batch_{i:02d}" for i in range(5)]
    for batch_id in ids:
        metadata.insert_batch(_batch(batch_id))
    first, more = metadata.list_batches(after=None, limit=2, descending=False)
    assert ([b.id for b in first], more) == (ids[:2], True)
    rest, more = metadata.list_batches(after=first[-1].id, limit=10, descending=False)
    assert ([b.id for b in rest], more) == (ids[2:], False)


def test_batch_pages_are_newest_first(metadata: MetadataStore) -> None:
    ids = [f"batch_{i:02d}" for i in range(7)]
    for batch_id in ids:
        metadata.insert_batch(_batch(batch_id))
    first, more = metadata.list_batches(after=None, limit=3)
    assert ([b.id for b in first], more) == (ids[::-1][:3], True)
    rest, more = metadata.list_batches(after=first[-1].id, limit=10)
    assert ([b.id for b in rest], more) == (ids[::-1][3:], False)


def test_batches_using_a_file_by_input_output_or_error(metadata: MetadataStore) -> None:
    metadata.insert_batch(_batch("batch_in", input_file_id="file-x"))
    metadata.insert_batch(attrs.evolve(_batch("batch_out", input_file_id="file-y"), output_file_id="file-x"))
    metadata.insert_batch(attrs.evolve(_batch("batch_err", input_file_id="file-y"), error_file_id="file-x"))
    metadata.insert_batch(_batch("batch_other", input_file_id="file-z"))
    assert {b.id for b in metadata.batches_using_file("file-x")} == {"batch_in", "batch_out", "batch_err"}
    assert metadata.batches_using_file("file-none") == []


# --- blobs and result writers ------------------------------------------------------------------
def test_blob_paths_are_distinct_and_staging_is_cleared(storage: Storage) -> None:
    blobs = storage.open_blobs()
    paths = {blobs.upload_path("file-a"), blobs.output_path("batch_a"), blobs.error_path("batch_a")}
    assert len(paths) == 3
    staged = [blobs.new_staging_path() for _ in range(3)]
    assert len(set(staged)) == 3
    for path in staged:
        path.write_bytes(b"half an upload")
    storage.open_blobs().clear_staging()
    assert not any(path.exists() for path in staged)
    blobs.remove(staged[0])  # removing what is gone is harmless


def _stored(blobs: BlobStore, file_id: str, data: bytes) -> Path:
    """An upload of ``data`` as a validated file is stored: in place, then published."""
    staging = blobs.new_staging_path()
    staging.write_bytes(data)
    path = blobs.upload_path(file_id)
    os.replace(staging, path)
    blobs.publish(path)
    return path


@settings(
    max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=4096))
def test_a_published_file_reads_the_same_on_every_replica(storage: Storage, data: bytes) -> None:
    blobs = storage.open_blobs()
    file_id = new_object_id("file-")
    path = _stored(blobs, file_id, data)
    blobs.publish(path)  # publishing again (a retried completion) is harmless
    assert blobs.readable(str(path)).read_bytes() == data
    assert storage.open_replica_blobs().readable(str(path)).read_bytes() == data


def test_a_file_larger_than_one_upload_part_reads_back_whole(storage: Storage) -> None:
    data = os.urandom(1 << 16) * 180  # 11.25 MiB: more than two of the store's 5 MiB parts
    path = _stored(storage.open_blobs(), new_object_id("file-"), data)
    assert storage.open_replica_blobs().readable(str(path)).read_bytes() == data


def test_replicas_reading_a_file_at_once_all_read_it_whole(storage: Storage) -> None:
    data = b"".join(b'{"custom_id":"r%d"}\n' % n for n in range(20000))
    path = _stored(storage.open_blobs(), new_object_id("file-"), data)
    replica = storage.open_replica_blobs()
    with ThreadPoolExecutor(8) as pool:
        copies = list(pool.map(lambda _: replica.readable(str(path)).read_bytes(), range(8)))
    assert copies == [data] * 8


def test_a_removed_file_is_gone_for_a_replica_that_had_not_read_it(storage: Storage) -> None:
    blobs = storage.open_blobs()
    path = _stored(blobs, new_object_id("file-"), b'{"custom_id":"a"}\n')
    replica = storage.open_replica_blobs()
    replica.remove(str(path))  # deleted through another replica than the one that stored it
    replica.remove(str(path))  # twice is harmless
    with pytest.raises(FileNotFoundError):
        replica.readable(str(path)).read_bytes()


def test_a_replica_starting_again_keeps_no_copy_of_a_removed_file(storage: Storage) -> None:
    blobs = storage.open_blobs()
    path = _stored(blobs, new_object_id("file-"), b'{"custom_id":"a"}\n')
    assert storage.open_replica_blobs().readable(str(path)).read_bytes() == b'{"custom_id":"a"}\n'
    blobs.remove(path)
    again = storage.open_replica_blobs()
    again.clear_staging()  # what a start does
    with pytest.raises(FileNotFoundError):
        again.readable(str(path)).read_bytes()


def test_result_lines_are_appended_synced_and_read_back(storage: Storage) -> None:
    blobs = storage.open_blobs()
    path = blobs.output_path("batch_a")
    writer = blobs.open_result_writer(path)
    assert not writer.opened
    usage = b'"usage":{"prompt_tokens":2,"completion_tokens":3}'
    for custom_id in ("a", "b"):
        writer.append(
            b'{"custom_id":"%s","response":{"body":{%s}},"error":null}\n' % (custom_id.encode(), usage)
        )
    writer.append(b'{"custom_id":"c","response":null,"error":{"code":"x","message":"y"}}\n')
    assert writer.opened
    writer.sync()
    writer.close()
    writer.close()  # twice is harmless
    with pytest.raises(ValueError):
        writer.append(b'{"custom_id":"d"}\n')
    finished = blobs.read_finished(path)
    assert (finished.custom_ids, finished.prompt_tokens, finished.completion_tokens) == (
        ["a", "b", "c"],
        4,
        6,
    )


def test_a_torn_last_line_is_cut_off_when_read_back(storage: Storage) -> None:
    blobs = storage.open_blobs()
    path = blobs.output_path("batch_torn")
    writer = blobs.open_result_writer(path)
    writer.append(b'{"custom_id":"whole","response":null,"error":{"code":"x","message":"y"}}\n')
    writer.close()
    with open(path, "ab") as stream:
        stream.write(b'{"custom_id":"torn","resp')
    assert blobs.read_finished(path).custom_ids == ["whole"]
    again = blobs.open_result_writer(path)  # a resumed batch appends after the last whole line
    again.append(b'{"custom_id":"next","response":null,"error":{"code":"x","message":"y"}}\n')
    again.close()
    assert blobs.read_finished(path).custom_ids == ["whole", "next"]
    assert blobs.read_finished(blobs.output_path("batch_never")).custom_ids == []


# --- metadata: webhook outbox ------------------------------------------------------------------
def _message(event_id: str, target: str, next_attempt_at: float) -> OutboxMessage:
    return OutboxMessage(event_id, target, b'{"id": "%s"}' % event_id.encode(), 1000, 0, next_attempt_at)


def test_outbox_messages_are_saved_with_the_status_and_kept_until_deleted(storage: Storage) -> None:
    store = storage.open_metadata()
    store.insert_batch(_batch("batch_a", status=BatchStatus.IN_PROGRESS))
    messages = [_message("evt_2", "http://b/", 1002.0), _message("evt_1", "http://a/", 1001.0)]
    ended = attrs.evolve(_batch("batch_a"), status=BatchStatus.COMPLETED, completed_at=1001)
    store.save_batch(ended, outbox=messages)
    store.save_batch(ended, outbox=[attrs.evolve(messages[0], body=b"other")])  # already there: kept
    store.close()
    store = storage.open_metadata()
    assert store.get_batch("batch_a") == ended
    assert store.pending_webhooks() == 2
    assert store.due_webhooks(1000.5, 10) == []
    assert store.due_webhooks(1002.0, 10) == [messages[1], messages[0]], "earliest first"
    assert store.due_webhooks(1002.0, 1) == [messages[1]]
    later = attrs.evolve(messages[1], attempts=1, next_attempt_at=3000.0, last_error="HTTP 500")
    store.reschedule_webhook(later)
    assert store.due_webhooks(2000.0, 10) == [messages[0]]
    assert store.due_webhooks(3000.0, 10) == [messages[0], later]
    store.delete_webhook("evt_2", "http://b/")
    store.delete_webhook("evt_2", "http://b/")  # harmless twice
    assert store.due_webhooks(3000.0, 10) == [later] and store.pending_webhooks() == 1
    store.close()


def test_due_webhooks_leave_out_the_targets_in_flight(metadata: MetadataStore) -> None:
    """A deliverer with an attempt in flight to a URL asks for the others' due messages only, so a
    URL with many waiting messages cannot fill every answer and starve the rest."""
    metadata.insert_batch(_batch("batch_a", status=BatchStatus.IN_PROGRESS))
    busy = [_message(f"evt_b{i}", "http://busy/", 1000.0 + i) for i in range(5)]
    other = [_message("evt_o1", "http://other/", 1003.5), _message("evt_t1", "http://third/", 1010.0)]
    ended = attrs.evolve(_batch("batch_a"), status=BatchStatus.COMPLETED, completed_at=1001)
    metadata.save_batch(ended, outbox=[*busy, *other])
    assert metadata.due_webhooks(2000.0, 3) == busy[:3]
    assert metadata.due_webhooks(2000.0, 3, skip_targets={"http://busy/"}) == other
    assert metadata.due_webhooks(2000.0, 10, skip_targets=["http://busy/", "http://third/"]) == other[:1]
    assert metadata.due_webhooks(2000.0, 10, skip_targets=()) == [*busy[:4], other[0], busy[4], other[1]]


def test_owners_round_trip_and_narrow_lists_and_cursors(metadata: MetadataStore) -> None:
    """Each file and batch keeps its owner; a list narrowed to an owner shows only its objects on
    every page, and refuses another owner's id as a cursor, as an id never stored."""
    for number, owner in enumerate(["a", "b", "a", "b", "a"]):
        metadata.insert_file(attrs.evolve(_file(f"file-{number}"), owner=owner))
        metadata.insert_batch(attrs.evolve(_batch(f"batch_{number}"), owner=owner))
    assert metadata.get_file("file-1") == attrs.evolve(_file("file-1"), owner="b")
    assert (metadata.get_batch("batch_1") or _batch("x")).owner == "b"
    pages: list[str] = []
    after = None
    while True:
        page, more = metadata.list_files(after=after, limit=1, descending=True, purpose=None, owner="a")
        pages += [file.id for file in page]
        if not more:
            break
        after = page[-1].id
    assert pages == ["file-4", "file-2", "file-0"]
    batches, _ = metadata.list_batches(after=None, limit=10, descending=False, owner="b")
    assert [batch.id for batch in batches] == ["batch_1", "batch_3"]
    assert len(metadata.list_batches(after=None, limit=10)[0]) == 5  # no owner: every one
    for call in (
        lambda: metadata.list_files(after="file-1", limit=5, descending=True, purpose=None, owner="a"),
        lambda: metadata.list_batches(after="batch_1", limit=5, owner="a"),
    ):
        with pytest.raises(InvalidRequest):
            call()
    metadata.delete_file("file-2")  # a deleted file still pages on for its owner only
    assert [
        f.id
        for f in metadata.list_files(after="file-2", limit=5, descending=True, purpose=None, owner="a")[0]
    ] == ["file-0"]
    with pytest.raises(InvalidRequest):
        metadata.list_files(after="file-2", limit=5, descending=True, purpose=None, owner="b")


def test_usage_sums_each_owners_saved_batch_counters(storage: Storage) -> None:
    store = storage.open_metadata()
    for number, (owner, counts, tokens) in enumerate(
        [("a", RequestCounts(3, 2, 1), Usage(10, 20)), ("b", RequestCounts(3, 3, 0), Usage(1, 2)),
         ("a", RequestCounts(3, 1, 0), Usage(5, 5))]
    ):  # fmt: skip
        batch = attrs.evolve(_batch(f"batch_{number}"), owner=owner)
        store.insert_batch(batch)
        store.save_batch(attrs.evolve(batch, request_counts=counts, usage=tokens))
    store.close()
    reopened = storage.open_metadata()  # the figures are durable
    usage = {entry.tenant: entry for entry in reopened.usage()}
    assert (
        usage["a"].batches,
        usage["a"].requests,
        usage["a"].prompt_tokens,
        usage["a"].completion_tokens,
    ) == (
        2,
        4,
        15,
        25,
    )
    assert usage["b"].requests == 3 and usage["b"].failed_requests == 0
    assert [entry.tenant for entry in reopened.usage("b")] == ["b"]
    assert reopened.usage("nobody") == []
    reopened.close()


# --- metadata: another process holding the write lock -----------------------------------------
_WRITES: dict[str, Callable[[MetadataStore], object]] = {
    "insert_file": lambda store: store.insert_file(_file("file-new")),
    "delete_file": lambda store: store.delete_file("file-a"),
    "insert_batch": lambda store: store.insert_batch(_batch("batch_new", "file-a")),
    "save_batch": lambda store: store.save_batch(_batch("batch_a", "file-a", BatchStatus.IN_PROGRESS)),
    "save_batch with outbox": lambda store: store.save_batch(
        _batch("batch_a", "file-a", BatchStatus.COMPLETED),
        outbox=[OutboxMessage("evt_2", "http://127.0.0.1:9/h", b"{}", 1000)],
    ),
    "put_idempotency_key": lambda store: store.put_idempotency_key("k2", "file", "f", "file-a", 1000),
    "delete_idempotency_key": lambda store: store.delete_idempotency_key("k1"),
    "reschedule_webhook": lambda store: store.reschedule_webhook(
        OutboxMessage("evt_1", "http://127.0.0.1:9/h", b"{}", 1000, attempts=1, next_attempt_at=5.0)
    ),
    "delete_webhook": lambda store: store.delete_webhook("evt_1", "http://127.0.0.1:9/h"),
}


def _seeded(storage: Storage) -> MetadataStore:
    store = storage.open_metadata()
    store.insert_file(_file("file-a"))
    store.insert_batch(_batch("batch_a", "file-a"))
    store.put_idempotency_key("k1", "file", "f", "file-a", 1000)
    store.save_batch(
        _batch("batch_a", "file-a", BatchStatus.IN_PROGRESS),
        outbox=[OutboxMessage("evt_1", "http://127.0.0.1:9/h", b"{}", 1000)],
    )
    return store


@pytest.mark.parametrize("write", sorted(_WRITES))
def test_a_write_under_another_process_lock_is_a_storage_fault_and_works_after(
    storage: Storage, write: str
) -> None:
    """The write gives up (it does not wait on for the lock: the caller may be the event loop)
    with an error that is a storage fault, a 503 with Retry-After, and changes nothing; reads keep
    answering; once the lock is gone the same write succeeds."""
    store = _seeded(storage)
    try:
        before = (store.get_file("file-a"), store.get_batch("batch_a"), store.get_idempotency_key("k1"))
        with storage.lock_elsewhere():
            with pytest.raises(Exception) as raised:  # each implementation raises its own error
                _WRITES[write](store)
            fault = storage_fault(raised.value, "save")
            assert isinstance(fault, StorageUnavailable), f"{write}: {raised.value!r} is not a storage fault"
            assert fault.code == "storage_unavailable" and not fault.disk_full and fault.retry_after_s >= 1
            assert (
                store.get_file("file-a"),
                store.get_batch("batch_a"),
                store.get_idempotency_key("k1"),
            ) == (before)
            assert store.list_files(after=None, limit=5, descending=True, purpose=None)[0]
            assert store.list_batches(after=None, limit=5)[0] and store.pending_webhooks() == 1
        _WRITES[write](store)
    finally:
        store.close()


def test_a_retry_batch_and_its_new_files_are_recorded_together_or_not_at_all(
    metadata: MetadataStore,
) -> None:
    metadata.insert_batch(_batch("batch_first"))
    retry = attrs.evolve(_batch("batch_retry", input_file_id="file-retry"), retry_of="batch_first")
    metadata.insert_batch(retry, files=(_file("file-retry"),))
    assert metadata.get_file("file-retry") == _file("file-retry")
    assert metadata.get_batch("batch_retry") == retry
    assert metadata.retries_of(["batch_first", "batch_retry"]) == {"batch_first": ("batch_retry",)}
    again = attrs.evolve(_batch("batch_retry", input_file_id="file-other"), retry_of="batch_first")
    with pytest.raises(Exception):  # noqa: B017 - the batch id exists: neither row is written
        metadata.insert_batch(again, files=(_file("file-other"), _file("file-other-output")))
    assert metadata.get_file("file-other") is None and metadata.get_file("file-other-output") is None
    second = attrs.evolve(_batch("batch_second", input_file_id="file-retry"), retry_of="batch_retry")
    metadata.insert_batch(second)
    assert metadata.retry_family("batch_first") == ["batch_first", "batch_retry", "batch_second"]
    assert metadata.retry_family("batch_retry") == ["batch_retry", "batch_second"]
    assert metadata.retry_family("batch_nope") == []
