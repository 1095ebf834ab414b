"""PostgresMetadataStore beyond the storage contract: what sharing one database means.

On a real PostgreSQL (``postgres_server``, a database of its own per test): two stores (two
servers) see each other's rows at once; an Idempotency-Key one of them recorded is refused to the
other; files made concurrently from both get distinct numbers and page once each; a restart of
the server (``pg_ctl restart -m immediate``) costs no call after it; a call while the server is
down fails within its timeouts as a storage fault; an unreachable URL fails the start without
showing its password; and the embedded ``BatchService`` runs, stops and resumes batches over it.
The classification of psycopg's errors as storage faults needs no server.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import msgspec
import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg_pool import PoolTimeout

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import StorageUnavailable
from batchgen.core.models import BatchStatus, FileObject
from batchgen.core.storage import MetadataStore
from batchgen.core.storage.faults import is_database_locked, storage_fault
from batchgen.core.storage.postgres_metadata import CONNECTION_WAIT_S, PostgresMetadataStore
from tests.live import free_port
from tests.postgres import PostgresServer

CHAT = "/v1/chat/completions"


def _file(file_id: str) -> FileObject:
    return FileObject(
        id=file_id,
        bytes=1,
        created_at=1000,
        filename="in.jsonl",
        purpose="batch",
        path=f"/data/{file_id}",
        line_count=1,
    )


# --- psycopg's errors as storage faults (no server) ----------------------------------------------
@pytest.mark.parametrize(
    ("error", "busy", "disk_full"),
    [
        (psycopg.errors.LockNotAvailable("lock timeout"), True, False),
        (psycopg.errors.QueryCanceled("statement timeout"), True, False),
        (psycopg.errors.SerializationFailure("could not serialize"), True, False),
        (psycopg.errors.DeadlockDetected("deadlock"), True, False),
        (psycopg.errors.AdminShutdown("terminating connection"), False, False),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), False, False),
        (psycopg.errors.DiskFull("could not extend file"), False, True),
        (psycopg.errors.ConnectionFailure("connection failure"), False, False),
        (psycopg.OperationalError("connection refused"), False, False),
        (PoolTimeout("couldn't get a connection"), False, False),
    ],
)
def test_postgres_errors_that_pass_or_mean_the_server_is_down_are_storage_faults(
    error: Exception, busy: bool, disk_full: bool
) -> None:
    fault = storage_fault(error, "save")
    assert isinstance(fault, StorageUnavailable)
    assert fault.disk_full is disk_full
    assert is_database_locked(error) is busy
    assert (fault.retry_after_s == 1) is busy


@given(message=st.text(max_size=40))
def test_postgres_errors_of_the_caller_are_not_storage_faults(message: str) -> None:
    for error in (
        psycopg.errors.UniqueViolation(message),
        psycopg.errors.UndefinedTable(message),
        psycopg.errors.SyntaxError(message),
        psycopg.errors.NotNullViolation(message),
        psycopg.ProgrammingError(message),
    ):
        assert storage_fault(error) is None and not is_database_locked(error)


# --- two stores on one database ------------------------------------------------------------------
def test_two_stores_on_one_database_share_rows_and_idempotency_keys(postgres_url: str) -> None:
    first, second = PostgresMetadataStore(postgres_url), PostgresMetadataStore(postgres_url)
    try:
        first.insert_file(_file("file-a"))
        assert second.get_file("file-a") == _file("file-a")
        first.put_idempotency_key("key-1", "file", "fp", "file-a", 1000)
        with pytest.raises(psycopg.errors.UniqueViolation):
            second.put_idempotency_key("key-1", "file", "other", "file-b", 1001)
        assert second.get_idempotency_key("key-1") == ("file", "fp", "file-a")
        second.delete_file("file-a")
        assert first.get_file("file-a") is None
        # a cursor naming the file the other store deleted still pages on
        first.insert_file(_file("file-b"))
        page, more = first.list_files(after="file-a", limit=10, descending=False, purpose=None)
        assert [f.id for f in page] == ["file-b"] and not more
    finally:
        first.close()
        second.close()


def test_files_made_at_once_from_two_stores_get_distinct_numbers_and_page_once(postgres_url: str) -> None:
    stores: list[PostgresMetadataStore] = []
    openers = [
        threading.Thread(target=lambda: stores.append(PostgresMetadataStore(postgres_url))) for _ in range(3)
    ]
    for opener in openers:  # servers starting together make the schema once, under its lock
        opener.start()
    for opener in openers:
        opener.join()
    assert len(stores) == 3
    stores.pop().close()
    errors: list[BaseException] = []

    def make(store: PostgresMetadataStore, prefix: str) -> None:
        try:
            for i in range(60):
                store.insert_file(_file(f"file-{prefix}-{i:02d}"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=make, args=(store, prefix))
        for store, prefix in ((stores[0], "a"), (stores[1], "b"), (stores[0], "c"), (stores[1], "d"))
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        seen: list[str] = []
        after = None
        while True:
            page, more = stores[1].list_files(after=after, limit=7, descending=False, purpose=None)
            seen += [f.id for f in page]
            if not more:
                break
            after = page[-1].id
        assert sorted(seen) == sorted(f"file-{p}-{i:02d}" for p in "abcd" for i in range(60))
        assert len(seen) == len(set(seen))
        for prefix in "abcd":  # one store's files keep the order it made them in
            mine = [file_id for file_id in seen if file_id.startswith(f"file-{prefix}-")]
            assert mine == sorted(mine)
    finally:
        for store in stores:
            store.close()


# --- the server's faults ---------------------------------------------------------------------------
def test_a_restart_of_postgres_costs_no_call_after_it(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    store = PostgresMetadataStore(postgres_url)
    try:
        store.insert_file(_file("file-before"))
        postgres_server.restart()
        assert store.get_file("file-before") == _file("file-before")  # the broken connection was replaced
        store.insert_file(_file("file-after"))
        assert [f.id for f in store.list_files(after=None, limit=5, descending=False, purpose=None)[0]] == [
            "file-before",
            "file-after",
        ]
    finally:
        store.close()


@pytest.mark.live  # starts a PostgreSQL of its own, to stop it
def test_a_call_while_postgres_is_down_is_a_storage_fault_within_its_timeouts() -> None:
    server = PostgresServer.start()
    try:
        store = PostgresMetadataStore(server.url())
        store.insert_file(_file("file-a"))
        server.stop()
        for call in (lambda: store.get_file("file-a"), lambda: store.insert_file(_file("file-b"))):
            started = time.monotonic()
            with pytest.raises(Exception) as raised:
                call()
            assert time.monotonic() - started < CONNECTION_WAIT_S + 3
            assert isinstance(storage_fault(raised.value, "save"), StorageUnavailable), raised.value
        store.close()
    finally:
        server.stop()
        server.remove()


def test_an_unreachable_database_fails_the_start_without_showing_its_password() -> None:
    url = f"postgresql://batchgen:s3cret-pw@127.0.0.1:{free_port()}/nowhere"
    started = time.monotonic()
    with pytest.raises(ConnectionError) as raised:
        PostgresMetadataStore(url)
    assert time.monotonic() - started < 20
    assert "s3cret-pw" not in str(raised.value) and "127.0.0.1" in str(raised.value)


# --- the embedded service over it ----------------------------------------------------------------
def _lines(count: int) -> bytes:
    return b"".join(
        msgspec.json.encode(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": CHAT,
                "body": {"messages": [{"role": "user", "content": f"hello {i}"}]},
            }
        )
        + b"\n"
        for i in range(count)
    )


def _service(tmp_path: Path, url: str, latency_s: float = 0.0) -> BatchService:
    def open_metadata(_path: Path) -> MetadataStore:
        return PostgresMetadataStore(url)

    settings = ServiceSettings(storage_path=tmp_path, counters_flush_interval_s=0.05, max_pool_size=8)
    return BatchService(settings, SimulatedBackend(latency_s=latency_s), open_metadata=open_metadata)


@pytest.mark.anyio
async def test_the_service_runs_a_batch_and_a_restart_resumes_one_over_postgres(
    tmp_path: Path, postgres_url: str
) -> None:
    async with _service(tmp_path, postgres_url) as service:
        file = await service.create_file(_lines(20))
        batch = await service.create_batch(file.id, CHAT, idempotency_key="key-1")
        again = await service.create_batch(file.id, CHAT, idempotency_key="key-1")
        assert again.id == batch.id
        with anyio.fail_after(30):
            done = await service.wait_for_batch(batch.id)
        assert done.status is BatchStatus.COMPLETED and done.request_counts.completed == 20
        slow = await service.create_batch(file.id, CHAT)
    # stopped with the second batch unfinished (latency 0: it may be done; the 200-line one is not)
    async with _service(tmp_path, postgres_url, latency_s=0.05) as service:
        big_file = await service.create_file(_lines(200))
        big = await service.create_batch(big_file.id, CHAT)
        with anyio.fail_after(30):
            while (await service.get_batch(big.id)).request_counts.completed < 10:
                await anyio.sleep(0.02)
    async with _service(tmp_path, postgres_url) as service:
        with anyio.fail_after(60):
            for batch_id in (slow.id, big.id):
                finished = await service.wait_for_batch(batch_id)
                assert finished.status is BatchStatus.COMPLETED
        resumed = await service.get_batch(big.id)
        assert resumed.request_counts.completed == 200 and resumed.request_counts.failed == 0
        assert resumed.output_file_id is not None
        path, size = await service.file_content(resumed.output_file_id)
        output = path.read_bytes()[:size].splitlines()
        ids = [msgspec.json.decode(line)["custom_id"] for line in output]
        assert sorted(ids) == sorted(f"r{i}" for i in range(200)) and len(ids) == len(set(ids))
        listed, _ = await service.list_batches()
        assert {b.id for b in listed} == {batch.id, slow.id, big.id}
