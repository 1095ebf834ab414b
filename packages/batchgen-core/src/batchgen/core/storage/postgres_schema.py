"""Whether a PostgreSQL schema is in place already, so a starting server runs no DDL beside live ones.

The metadata store and the shard ledger each make their tables with idempotent statements
(``CREATE … IF NOT EXISTS``, ``ADD COLUMN IF NOT EXISTS``). Idempotent is not harmless: each such
statement takes a strong lock on its table even when it changes nothing, so a replica restarting
beside live ones can deadlock with their transactions (PostgreSQL then fails the start with
``DeadlockDetected``). So each part of the schema records the SHA-256 of its statements in
``batchgen_schema`` once it has run them, and a start whose statements match the record runs none
of them: it only reads. A part that is missing or differs (a first start, a version that adds a
column) runs its statements under the caller's advisory lock, as before, and records them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from psycopg import AsyncConnection, Connection

__all__ = ["record_schema", "schema_fingerprint", "schema_is_current", "schema_is_current_async"]

_TABLE_EXISTS = "SELECT to_regclass('batchgen_schema') IS NOT NULL"
_RECORDED = "SELECT fingerprint FROM batchgen_schema WHERE part = %s"
#: Held while ``batchgen_schema`` is made and written: the parts are made under locks of their own.
_RECORD_LOCK = 0x6267_7363_6865_6D61  # "bgschema"
_RECORD = (
    "SELECT pg_advisory_xact_lock(%s)",
    "CREATE TABLE IF NOT EXISTS batchgen_schema (part TEXT PRIMARY KEY, fingerprint TEXT NOT NULL)",
    "INSERT INTO batchgen_schema (part, fingerprint) VALUES (%s, %s) "
    "ON CONFLICT (part) DO UPDATE SET fingerprint = EXCLUDED.fingerprint",
)


def schema_fingerprint(statements: Iterable[str]) -> str:
    """The SHA-256 of ``statements``, in order."""
    digest = hashlib.sha256()
    for statement in statements:
        digest.update(statement.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def schema_is_current(connection: Connection[Any], part: str, fingerprint: str) -> bool:
    """Whether ``part`` of the schema was made by statements with this ``fingerprint``."""
    if not _first(connection.execute(_TABLE_EXISTS).fetchone()):
        return False
    return _first(connection.execute(_RECORDED, (part,)).fetchone()) == fingerprint


async def schema_is_current_async(connection: AsyncConnection[Any], part: str, fingerprint: str) -> bool:
    """``schema_is_current`` over an asynchronous connection."""
    if not _first(await (await connection.execute(_TABLE_EXISTS)).fetchone()):
        return False
    return _first(await (await connection.execute(_RECORDED, (part,))).fetchone()) == fingerprint


def record_schema(part: str, fingerprint: str) -> list[tuple[str, tuple[object, ...]]]:
    """The statements (with their parameters) that record ``part`` as made, to run in the
    transaction that made it."""
    lock, create, upsert = _RECORD
    return [(lock, (_RECORD_LOCK,)), (create, ()), (upsert, (part, fingerprint))]


def _first(row: tuple[Any, ...] | None) -> Any:
    """A row's first value (the connections here return tuples); None for no row."""
    return None if row is None else row[0]
