"""A server starting beside live ones takes no table lock to make a schema that is there already.

The metadata store and the shard ledger on a real PostgreSQL: with another transaction holding
every table (as live replicas' reads and writes do), a second store or ledger starts at once and
works, where running its idempotent DDL again would wait on those tables (and could deadlock).
A database whose recorded schema differs from the code's (a newer version's) runs the DDL again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import psycopg
import pytest

from batchgen.core.storage.postgres_metadata import PostgresMetadataStore
from batchgen.core.work.postgres_ledger import PostgresShardLedger

#: Long enough for a start on a loaded machine; a start waiting on a lock fails within its own timeout.
START_DEADLINE_S = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextmanager
def every_table_held(url: str, mode: str = "ACCESS SHARE") -> Iterator[None]:
    """A transaction holding every table of ``url``'s public schema in ``mode`` (but the record of
    the schema itself) until the block ends."""
    with psycopg.connect(url) as holder:
        tables = [
            row[0]
            for row in holder.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'batchgen_schema'"
            )
        ]
        assert tables
        for table in tables:
            holder.execute(f'LOCK TABLE "{table}" IN {mode} MODE'.encode())
        try:
            yield
        finally:
            holder.rollback()


def _in_thread(start: Callable[[], None]) -> BaseException | None:
    """Run ``start`` in a thread; what it raised, or None. Fails the test if it is still waiting."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            start()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(START_DEADLINE_S)
    assert not thread.is_alive(), "the start is still waiting on the held tables"
    return errors[0] if errors else None


def test_a_metadata_store_starting_beside_a_live_one_waits_on_no_table(postgres_url: str) -> None:
    first = PostgresMetadataStore(postgres_url)
    try:
        with every_table_held(postgres_url):
            stores: list[PostgresMetadataStore] = []
            assert _in_thread(lambda: stores.append(PostgresMetadataStore(postgres_url))) is None
        second = stores[0]
        assert second.list_files(after=None, limit=5, descending=False, purpose=None) == ([], False)
        second.close()
    finally:
        first.close()


def test_a_metadata_store_on_an_older_schema_makes_what_is_missing(postgres_url: str) -> None:
    PostgresMetadataStore(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute("ALTER TABLE files DROP COLUMN owner")
        connection.execute("UPDATE batchgen_schema SET fingerprint = 'older' WHERE part = 'metadata'")
    store = PostgresMetadataStore(postgres_url)
    try:
        with psycopg.connect(postgres_url) as connection:
            columns = {
                row[0]
                for row in connection.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = 'files'"
                )
            }
        assert "owner" in columns
    finally:
        store.close()


@pytest.mark.anyio
async def test_a_ledger_starting_beside_a_live_one_waits_on_no_table(postgres_url: str) -> None:
    async with PostgresShardLedger(postgres_url) as first:
        await first.create_schema()
        assert await first.add_batch("batch-1", 10)

        def second_start() -> None:
            async def start() -> None:
                async with PostgresShardLedger(postgres_url) as second:
                    await second.create_schema()

            anyio.run(start)

        with every_table_held(postgres_url, "ROW EXCLUSIVE"):
            error = await anyio.to_thread.run_sync(lambda: _in_thread(second_start))
        assert error is None, error
        assert await first.add_batch("batch-2", 10)
