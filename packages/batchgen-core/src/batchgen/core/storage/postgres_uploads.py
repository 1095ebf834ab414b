"""PostgresUploadRecords: the Uploads API's uploads and their parts in PostgreSQL, for replicas.

Two tables (made with the metadata store's schema, ``UPLOAD_SCHEMA``, idempotent):

``uploads``       one row per upload: its ``Upload`` record (``upload_rules``), the part order,
                  sizes and file id once it is ``completing``.
``upload_parts``  one row per part stored (its bytes live in the blob store, ``upload_part_blobs``).

Rules the SQL keeps, whatever the replicas do:

- A part is recorded in one transaction that holds its upload's row (``FOR UPDATE``): the checks
  the caller gives (the upload still pending, room for the part, the number of parts) see every
  part recorded before, so two parts sent at once to two replicas cannot both pass them.
- Every state change is a conditional UPDATE from the state it leaves: exactly one caller moves an
  upload from ``pending`` to ``completing`` (or ``cancelled``, ``expired``), and from
  ``completing`` to ``completed``, which also inserts its file's row, in the same transaction.
- A tenant's ``max_stored_bytes`` is checked and spent in one transaction under an advisory lock
  per tenant (``lock_tenant``): the bytes of its files (results not counted) and of the parts of
  its pending and completing uploads, summed with the lock held, then the file or part inserted
  (``StoredBytesExceeded`` when it would pass the limit). Two replicas never both pass it. A new
  upload counts its owner's open uploads under the same lock (``OpenUploadsAtLimit``).

Every call waits on the network: the service makes them in worker threads (``MetadataCalls``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from batchgen.core.models import (
    COMPLETED,
    COMPLETING,
    DEFAULT_TENANT,
    ENDED,
    HOLDING_PARTS,
    OUTPUT_PURPOSE,
    PENDING,
    FileObject,
    Upload,
)
from batchgen.core.storage.stored_bytes import OpenUploadsAtLimit, StoredBytesExceeded

__all__ = ["UPLOAD_SCHEMA", "PostgresUploadRecords", "lock_tenant", "spend_stored_bytes", "stored_bytes"]

Connection = psycopg.Connection[dict[str, Any]]

UPLOAD_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS uploads (id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, "
    "bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, ended_at BIGINT, "
    "filename TEXT NOT NULL, purpose TEXT NOT NULL, mime_type TEXT NOT NULL, "
    "part_order TEXT[] NOT NULL DEFAULT '{}', sizes BIGINT[] NOT NULL DEFAULT '{}', "
    "skip_bom BOOLEAN NOT NULL DEFAULT false, file_id TEXT, line_count BIGINT NOT NULL DEFAULT 0, url TEXT)",
    # the lifetime of the file an upload makes (OpenAI's expires_after): a column added later
    "ALTER TABLE uploads ADD COLUMN IF NOT EXISTS expires_after_s BIGINT",
    "CREATE INDEX IF NOT EXISTS uploads_due ON uploads (expires_at) WHERE status = 'pending'",
    "CREATE INDEX IF NOT EXISTS uploads_ended ON uploads (ended_at) WHERE ended_at IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS uploads_owner ON uploads (owner, status)",
    "CREATE TABLE IF NOT EXISTS upload_parts (upload_id TEXT NOT NULL, part_id TEXT NOT NULL, "
    "bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, PRIMARY KEY (upload_id, part_id))",
)

#: The first key of the advisory locks a tenant's stored bytes are spent under (the second is
#: the hash of the tenant's name).
_QUOTA_LOCK_CLASS = 0x62677175  # "bgqu"
#: How long spending waits for another replica spending the same tenant's bytes.
QUOTA_LOCK_WAIT_MS = 3000
#: How long a part waits for another part of the same upload being recorded.
UPLOAD_LOCK_WAIT_MS = 3000

_STORED = """
SELECT (SELECT COALESCE(sum(bytes), 0) FROM files
         WHERE COALESCE(owner, %(default)s) = %(tenant)s AND purpose <> %(output)s)
     + (SELECT COALESCE(sum(p.bytes), 0) FROM upload_parts p JOIN uploads u ON u.id = p.upload_id
         WHERE u.owner = %(tenant)s AND u.status = ANY(%(holding)s)) AS used
"""


def stored_bytes(connection: Connection, tenant: str) -> int:
    """The bytes ``tenant`` holds: its files (batch results not counted), and the parts of its
    uploads not completed yet (what ``ChunkedUploads.check_quota`` counts)."""
    row = connection.execute(
        _STORED,
        {
            "default": DEFAULT_TENANT,
            "tenant": tenant,
            "output": OUTPUT_PURPOSE,
            "holding": list(HOLDING_PARTS),
        },
    ).fetchone()
    assert row is not None
    return int(row["used"])


def lock_tenant(connection: Connection, tenant: str) -> None:
    """Hold the tenant's stored-bytes lock until the transaction ends."""
    connection.execute("SELECT set_config('lock_timeout', %s, true)", [f"{QUOTA_LOCK_WAIT_MS}ms"])
    connection.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [_QUOTA_LOCK_CLASS, tenant])


def spend_stored_bytes(connection: Connection, tenant: str, adding: int, limit: int | None) -> None:
    """Inside a transaction about to record ``adding`` bytes of ``tenant``: with ``limit``, lock
    the tenant and raise StoredBytesExceeded when the bytes would pass it (the lock is held until
    the record is committed, so no other replica counts without it)."""
    if limit is None:
        return
    lock_tenant(connection, tenant)
    used = stored_bytes(connection, tenant)
    if used + adding > limit:
        raise StoredBytesExceeded(used, adding, limit)


def _upload(row: dict[str, Any]) -> Upload:
    return Upload(
        id=row["id"],
        bytes=row["bytes"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        filename=row["filename"],
        purpose=row["purpose"],
        mime_type=row["mime_type"],
        owner=row["owner"],
        status=row["status"],
        ended_at=row["ended_at"],
        order=row["part_order"],
        sizes=row["sizes"],
        skip_bom=row["skip_bom"],
        file_id=row["file_id"],
        line_count=row["line_count"],
        url=row["url"],
        expires_after_s=row["expires_after_s"],
    )


#: Checks a part must pass, given its upload (locked), the bytes and count of its parts so far.
PartCheck = Callable[[Upload, int, int], None]


class PostgresUploadRecords:
    """Uploads and their parts, through the metadata store's connections: ``transaction()``
    gives one connection for one transaction, ``insert_file(connection, file)`` writes a file's
    row (``PostgresMetadataStore`` gives both)."""

    def __init__(
        self,
        transaction: Callable[[], AbstractContextManager[Connection]],
        insert_file: Callable[[Connection, FileObject], None],
    ) -> None:
        self._transaction = transaction
        self._insert_file = insert_file

    def _one(self, query: str, params: Sequence[Any]) -> dict[str, Any] | None:
        with self._transaction() as connection:
            return connection.execute(query, params).fetchone()

    def insert(self, upload: Upload, *, max_stored_bytes: int | None, max_open: int | None = None) -> None:
        """Record a new upload; with ``max_stored_bytes``, only while its declared size fits
        beside what the owner holds (StoredBytesExceeded); with ``max_open``, only while the owner
        has fewer open (pending or completing) uploads (OpenUploadsAtLimit), counted under its lock."""
        with self._transaction() as connection:
            if max_open is not None:
                lock_tenant(connection, upload.owner)
                row = connection.execute(
                    "SELECT count(*) AS open FROM uploads WHERE owner = %s AND status = ANY(%s)",
                    [upload.owner, list(HOLDING_PARTS)],
                ).fetchone()
                open_now = 0 if row is None else int(row["open"])
                if open_now >= max_open:
                    raise OpenUploadsAtLimit(open_now, max_open)
            spend_stored_bytes(connection, upload.owner, upload.bytes, max_stored_bytes)
            connection.execute(
                "INSERT INTO uploads (id, owner, status, bytes, created_at, expires_at, filename, purpose, "
                "mime_type, expires_after_s) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                [
                    upload.id,
                    upload.owner,
                    upload.status,
                    upload.bytes,
                    upload.created_at,
                    upload.expires_at,
                    upload.filename,
                    upload.purpose,
                    upload.mime_type,
                    upload.expires_after_s,
                ],
            )

    def get(self, upload_id: str) -> Upload | None:
        row = self._one("SELECT * FROM uploads WHERE id = %s", [upload_id])
        return None if row is None else _upload(row)

    def parts(self, upload_id: str) -> dict[str, int]:
        """The parts recorded: id -> bytes, in the order they were recorded."""
        with self._transaction() as connection:
            rows = connection.execute(
                "SELECT part_id, bytes FROM upload_parts WHERE upload_id = %s ORDER BY created_at, part_id",
                [upload_id],
            ).fetchall()
        return {row["part_id"]: int(row["bytes"]) for row in rows}

    def stored_bytes(self, tenant: str) -> int:
        with self._transaction() as connection:
            return stored_bytes(connection, tenant)

    def add_part(
        self,
        upload_id: str,
        part_id: str,
        size: int,
        created_at: int,
        *,
        check: PartCheck,
        max_stored_bytes: int | None,
    ) -> bool:
        """Record a part stored already, if ``check(upload, bytes so far, parts so far)`` passes
        (it raises otherwise) and, with ``max_stored_bytes``, the owner's bytes stay within it
        (StoredBytesExceeded); False when there is no such upload. One transaction: a refusal
        records nothing."""
        with self._transaction() as connection:
            connection.execute("SELECT set_config('lock_timeout', %s, true)", [f"{UPLOAD_LOCK_WAIT_MS}ms"])
            row = connection.execute("SELECT * FROM uploads WHERE id = %s FOR UPDATE", [upload_id]).fetchone()
            if row is None:
                return False
            upload = _upload(row)
            have = connection.execute(
                "SELECT COALESCE(sum(bytes), 0) AS bytes, count(*) AS parts FROM upload_parts "
                "WHERE upload_id = %s",
                [upload_id],
            ).fetchone()
            assert have is not None
            check(upload, int(have["bytes"]), int(have["parts"]))
            spend_stored_bytes(connection, upload.owner, size, max_stored_bytes)
            connection.execute(
                "INSERT INTO upload_parts (upload_id, part_id, bytes, created_at) VALUES (%s, %s, %s, %s)",
                [upload_id, part_id, size, created_at],
            )
        return True

    def begin_completing(self, completing: Upload) -> bool:
        """Turn a pending upload ``completing`` with its order, sizes, file id and what validation
        found; False when it is not pending any more (another replica moved it first)."""
        with self._transaction() as connection:
            moved = connection.execute(
                "UPDATE uploads SET status = %s, part_order = %s, sizes = %s, skip_bom = %s, file_id = %s, "
                "line_count = %s, url = %s WHERE id = %s AND status = %s",
                [
                    COMPLETING,
                    list(completing.order),
                    list(completing.sizes),
                    completing.skip_bom,
                    completing.file_id,
                    completing.line_count,
                    completing.url,
                    completing.id,
                    PENDING,
                ],
            )
            return moved.rowcount == 1

    def complete(self, upload_id: str, file: FileObject, ended_at: int) -> bool:
        """Turn a completing upload ``completed`` and insert its file's row, in one step; False
        (and nothing written) when it is not completing with that file (another replica did it)."""
        with self._transaction() as connection:
            connection.execute("SELECT set_config('lock_timeout', %s, true)", [f"{UPLOAD_LOCK_WAIT_MS}ms"])
            moved = connection.execute(
                "UPDATE uploads SET status = %s, ended_at = %s WHERE id = %s AND status = %s AND file_id = %s",
                [COMPLETED, ended_at, upload_id, COMPLETING, file.id],
            )
            if moved.rowcount != 1:
                return False
            self._insert_file(connection, file)
        return True

    def end(self, upload_id: str, status: str, ended_at: int) -> bool:
        """Cancel or expire a pending upload; False when it is not pending any more."""
        with self._transaction() as connection:
            moved = connection.execute(
                "UPDATE uploads SET status = %s, ended_at = %s WHERE id = %s AND status = %s",
                [status, ended_at, upload_id, PENDING],
            )
            return moved.rowcount == 1

    def forget_parts(self, upload_id: str) -> None:
        """Delete the records of an ended upload's parts (their bytes deleted first)."""
        with self._transaction() as connection:
            connection.execute("DELETE FROM upload_parts WHERE upload_id = %s", [upload_id])

    def due(self, now: int, limit: int) -> list[str]:
        """Up to ``limit`` pending uploads past their ``expires_at``."""
        with self._transaction() as connection:
            rows = connection.execute(
                "SELECT id FROM uploads WHERE status = %s AND expires_at <= %s ORDER BY expires_at LIMIT %s",
                [PENDING, now, limit],
            ).fetchall()
        return [row["id"] for row in rows]

    def ended_with_parts(self, limit: int) -> list[str]:
        """Up to ``limit`` ended uploads that still have parts recorded (their deletion was cut
        short: a crash, the store unreachable)."""
        with self._transaction() as connection:
            rows = connection.execute(
                "SELECT DISTINCT p.upload_id FROM upload_parts p JOIN uploads u ON u.id = p.upload_id "
                "WHERE u.status = ANY(%s) LIMIT %s",
                [list(ENDED), limit],
            ).fetchall()
        return [row["upload_id"] for row in rows]

    def ended_before(self, moment: int, limit: int) -> list[str]:
        """Up to ``limit`` uploads that ended at or before ``moment``."""
        with self._transaction() as connection:
            rows = connection.execute(
                "SELECT id FROM uploads WHERE ended_at IS NOT NULL AND ended_at <= %s AND status = ANY(%s) "
                "LIMIT %s",
                [moment, list(ENDED), limit],
            ).fetchall()
        return [row["id"] for row in rows]

    def forget(self, upload_ids: Sequence[str]) -> None:
        """Delete the records of ended uploads and their parts."""
        with self._transaction() as connection:
            connection.execute("DELETE FROM upload_parts WHERE upload_id = ANY(%s)", [list(upload_ids)])
            connection.execute(
                "DELETE FROM uploads WHERE id = ANY(%s) AND status = ANY(%s)", [list(upload_ids), list(ENDED)]
            )
