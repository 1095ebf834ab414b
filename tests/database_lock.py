"""A database held locked by someone else, for the length of a ``with`` block: a second, real
SQLite connection (what another process would open) holding ``BEGIN EXCLUSIVE`` on a file, or a
second PostgreSQL connection holding every metadata table in ``EXCLUSIVE`` mode (writes wait on
it, reads do not)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def locked_elsewhere(database: Path) -> Iterator[sqlite3.Connection]:
    """Hold ``database`` locked (``BEGIN EXCLUSIVE``) inside the block; released at its end."""
    holder = sqlite3.connect(str(database), isolation_level=None, timeout=10)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        yield holder
        holder.execute("ROLLBACK")
    finally:
        holder.close()


#: The metadata tables of ``PostgresMetadataStore``.
_POSTGRES_TABLES = "files, deleted_files, idempotency_keys, batches, webhook_outbox"


@contextmanager
def postgres_locked_elsewhere(url: str) -> Iterator[object]:
    """Hold the metadata tables at ``url`` locked against writes inside the block."""
    import psycopg

    with psycopg.connect(url, autocommit=False) as holder:
        holder.execute(f"LOCK TABLE {_POSTGRES_TABLES} IN EXCLUSIVE MODE")
        yield holder
        holder.rollback()
