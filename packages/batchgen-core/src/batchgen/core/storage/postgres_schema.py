"""Whether a PostgreSQL schema is in place already, so a starting server runs no DDL beside live ones.

The metadata store, the shard ledger and the API key store each make their tables with idempotent statements
(``CREATE … IF NOT EXISTS``, ``ADD COLUMN IF NOT EXISTS``). Idempotent is not harmless: each such
statement takes a strong lock on its table even when it changes nothing, so a replica restarting
beside live ones can deadlock with their transactions (PostgreSQL then fails the start with
``DeadlockDetected``). So each part of the schema records the SHA-256 of its statements in
``batchgen_schema`` once it has run them, and a start whose statements match the record runs none
of them: it only reads. A part that is missing or differs (a first start, a version that adds a
column) runs its statements under its advisory lock, as before, and records them. ``make_schema``
(a blocking connection) and ``make_schema_async`` do both, in one transaction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from psycopg import AsyncConnection, Connection

__all__ = ["make_schema", "make_schema_async"]

_TABLE_EXISTS = "SELECT to_regclass('batchgen_schema') IS NOT NULL"
_RECORDED = "SELECT fingerprint FROM batchgen_schema WHERE part = %s"
_LOCK = "SELECT pg_advisory_xact_lock(%s)"
_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %s, true)"
#: Held while ``batchgen_schema`` is made and written: the parts are made under locks of their own.
_RECORD_LOCK = 0x6267_7363_6865_6D61  # "bgschema"
_CREATE_RECORD = (
    "CREATE TABLE IF NOT EXISTS batchgen_schema (part TEXT PRIMARY KEY, fingerprint TEXT NOT NULL)"
)
_RECORD = (
    "INSERT INTO batchgen_schema (part, fingerprint) VALUES (%s, %s) "
    "ON CONFLICT (part) DO UPDATE SET fingerprint = EXCLUDED.fingerprint"
)


def make_schema(
    connection: Connection[Any], part: str, statements: Sequence[str], lock: int, *, lock_timeout_ms: int = 0
) -> None:
    """Run ``statements`` under the advisory lock ``lock`` and record them as ``part``, unless the
    record says they ran already; then commit. ``lock_timeout_ms`` (0: none) bounds each lock wait."""
    fingerprint = _fingerprint(statements)
    made = connection.execute(_TABLE_EXISTS).fetchone() == (True,)
    if made and connection.execute(_RECORDED, (part,)).fetchone() == (fingerprint,):
        connection.commit()
        return  # no DDL: its table locks could deadlock with servers already running
    if lock_timeout_ms:
        connection.execute(_LOCK_TIMEOUT, (f"{lock_timeout_ms}ms",))
    connection.execute(_LOCK, (lock,))
    for statement in statements:
        connection.execute(statement.encode())
    connection.execute(_LOCK, (_RECORD_LOCK,))
    connection.execute(_CREATE_RECORD)
    connection.execute(_RECORD, (part, fingerprint))
    connection.commit()


async def make_schema_async(
    connection: AsyncConnection[Any], part: str, statements: Sequence[str], lock: int
) -> None:
    """``make_schema`` over an asynchronous connection, inside a transaction of its own."""
    fingerprint = _fingerprint(statements)
    async with connection.transaction():
        made = await (await connection.execute(_TABLE_EXISTS)).fetchone() == (True,)
        if made and await (await connection.execute(_RECORDED, (part,))).fetchone() == (fingerprint,):
            return  # no DDL: its table locks could deadlock with servers already running
        await connection.execute(_LOCK, (lock,))
        for statement in statements:
            await connection.execute(statement.encode())
        await connection.execute(_LOCK, (_RECORD_LOCK,))
        await connection.execute(_CREATE_RECORD)
        await connection.execute(_RECORD, (part, fingerprint))


def _fingerprint(statements: Sequence[str]) -> str:
    """The SHA-256 of ``statements``, in order."""
    digest = hashlib.sha256()
    for statement in statements:
        digest.update(statement.encode())
        digest.update(b"\0")
    return digest.hexdigest()
