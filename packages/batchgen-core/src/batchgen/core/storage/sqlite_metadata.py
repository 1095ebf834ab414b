"""SQLiteMetadataStore: files, batches and idempotency keys in one SQLite database (WAL mode).

The ``MetadataStore`` protocol (``storage.interfaces``) through sqlite-utils; the contract tests
in ``tests/core/test_storage_contract.py`` say what any other implementation must do as well.
Rows keep an insertion sequence number, which gives lists a stable newest-first order and
``after`` cursors that survive equal timestamps. A deleted file leaves its id and sequence number
behind (``deleted_files``, two small columns), so a client paging with a cursor that names a file
deleted meanwhile carries on where it was, and numbers are never reused; an id that never existed
is refused as a cursor.

Each file and batch records its ``owner`` (the tenant that made it); lists and cursors can be
narrowed to one owner, and ``usage`` sums the saved counters of each owner's batches.

The store is called from the event loop, so no call may wait long for a lock: once the schema is
made (which waits up to ``OPEN_BUSY_TIMEOUT_S`` at start), SQLite's busy timeout is
``BUSY_TIMEOUT_S``. A write that finds the database locked by another connection for longer
raises SQLite's "database is locked", which ``storage.faults`` turns into ``StorageUnavailable``
(503 with ``Retry-After``): the caller retries later, off the loop, instead of the loop stalling.
Reads do not wait (WAL: readers never wait for a writer).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import attrs
import sqlite_utils

from batchgen.core.models import Batch, FileObject
from batchgen.core.storage.interfaces import IdempotencyRecord
from batchgen.core.storage.metadata_queries import (
    cursor_seq_query,
    owner_clause,
    retry_family_query,
    unknown_cursor,
    usage_query,
)
from batchgen.core.storage.metadata_rows import (
    ACTIVE_STATUSES,
    BATCH_COLUMNS,
    FILE_COLUMNS,
    OUTBOX_COLUMNS,
    batch_from_row,
    batch_to_row,
    file_from_row,
    file_to_row,
)
from batchgen.core.tenancy import TenantUsage
from batchgen.core.webhook_outbox import OutboxMessage

#: How long the schema set-up at start waits for another connection's lock.
OPEN_BUSY_TIMEOUT_S = 5.0
#: How long any later call waits for another connection's lock before failing as "database is locked".
BUSY_TIMEOUT_S = 0.1


class SQLiteMetadataStore:
    """Files and batches, persisted in SQLite at ``path``."""

    def __init__(self, path: Path) -> None:
        connection = sqlite3.connect(
            str(path), check_same_thread=False, isolation_level=None, timeout=OPEN_BUSY_TIMEOUT_S
        )
        self._db = sqlite_utils.Database(connection)
        self._db.enable_wal()
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._files = self._db.table("files")
        self._batches = self._db.table("batches")
        if not self._files.exists():
            self._files.create(FILE_COLUMNS, pk="id", not_null={"seq"})
            self._files.create_index(["seq"], unique=True)
        self._deleted_files = self._db.table("deleted_files")
        if not self._deleted_files.exists():
            self._deleted_files.create({"id": str, "seq": int}, pk="id", not_null={"seq"})
        self._idempotency = self._db.table("idempotency_keys")
        if not self._idempotency.exists():
            self._idempotency.create(
                {"key": str, "scope": str, "fingerprint": str, "object_id": str, "created_at": int}, pk="key"
            )
        if not self._batches.exists():
            self._batches.create(BATCH_COLUMNS, pk="id", not_null={"seq"})
            self._batches.create_index(["seq"], unique=True)
            self._batches.create_index(["status"])
            self._batches.create_index(["input_file_id"])
        self._outbox = self._db.table("webhook_outbox")
        if not self._outbox.exists():
            self._outbox.create(OUTBOX_COLUMNS, pk=("event_id", "target"))
            self._outbox.create_index(["next_attempt_at"])
        missing = set(BATCH_COLUMNS) - set(self._batches.columns_dict)
        for column in sorted(missing):  # a database made by an older version
            self._batches.add_column(column, BATCH_COLUMNS[column])
        for table in (self._files, self._deleted_files):  # owners, added with tenants
            if "owner" not in table.columns_dict:
                table.add_column("owner", str)
        self._batches.create_index(["owner", "seq"], if_not_exists=True)
        self._batches.create_index(["retry_of"], if_not_exists=True)
        self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")

    def close(self) -> None:
        self._db.close()

    def _next_seq(self, table: str) -> int:
        query = f"SELECT COALESCE(MAX(seq), 0) + 1 FROM {table}"
        if table == "files":  # a deleted file's number is never given again
            query = "SELECT MAX((SELECT COALESCE(MAX(seq), 0) FROM files), "
            query += "(SELECT COALESCE(MAX(seq), 0) FROM deleted_files)) + 1"
        row = self._db.execute(query).fetchone()
        return int(row[0])

    def _cursor_seq(self, table: str, object_id: str, owner: str | None = None) -> int:
        """The sequence number of the object an ``after`` cursor names, deleted or not; with
        ``owner``, only an object of that owner counts (another's id is refused as unknown)."""
        row = self._db.execute(*cursor_seq_query(table, object_id, owner, "?")).fetchone()
        if row is None:
            raise unknown_cursor(table, object_id)
        return int(row[0])

    # --- files -----------------------------------------------------------------------------
    def insert_file(self, file: FileObject, *, idempotency: IdempotencyRecord | None = None) -> None:
        row = {"seq": self._next_seq("files"), **file_to_row(file)}
        with self._db.atomic():
            self._deleted_files.delete_where("id = ?", [file.id])  # an id used again is live again
            self._files.insert(row)
            self._put_key(idempotency, file.id)

    def get_file(self, file_id: str) -> FileObject | None:
        rows = list(self._files.rows_where("id = ?", [file_id], limit=1))
        return file_from_row(rows[0]) if rows else None

    def expired_files(self, now: int) -> list[FileObject]:
        rows = self._files.rows_where("expires_at IS NOT NULL AND expires_at <= ?", [now], order_by="seq")
        return [file_from_row(row) for row in rows]

    def delete_file(self, file_id: str) -> None:
        self._db.execute(
            "INSERT OR IGNORE INTO deleted_files (id, seq, owner) SELECT id, seq, owner FROM files WHERE id = ?",
            [file_id],
        )
        self._files.delete_where("id = ?", [file_id])

    def list_files(
        self,
        *,
        after: str | None,
        limit: int,
        descending: bool,
        purpose: str | None,
        owner: str | None = None,
    ) -> tuple[list[FileObject], bool]:
        """Return up to ``limit`` files after the cursor (of ``owner`` only, if given), and whether
        more follow."""
        clauses: list[str] = []
        params: list[Any] = []
        if purpose is not None:
            clauses.append("purpose = ?")
            params.append(purpose)
        if owner is not None:
            clause, clause_params = owner_clause(owner, "?")
            clauses.append(clause)
            params += clause_params
        if after is not None:
            clauses.append(f"seq {'<' if descending else '>'} ?")
            params.append(self._cursor_seq("files", after, owner))
        rows = list(
            self._files.rows_where(
                " AND ".join(clauses) or None,
                params,
                order_by=f"seq {'DESC' if descending else 'ASC'}",
                limit=limit + 1,
            )
        )
        return [file_from_row(row) for row in rows[:limit]], len(rows) > limit

    # --- idempotency keys ------------------------------------------------------------------
    def get_idempotency_key(self, key: str) -> tuple[str, str, str] | None:
        """(scope, fingerprint, object_id) recorded for ``key``, if any."""
        rows = list(self._idempotency.rows_where("key = ?", [key], limit=1))
        if not rows:
            return None
        return rows[0]["scope"], rows[0]["fingerprint"], rows[0]["object_id"]

    def _put_key(self, record: IdempotencyRecord | None, object_id: str) -> None:
        if record is not None:
            self.put_idempotency_key(
                record.key, record.scope, record.fingerprint, object_id, record.created_at
            )

    def put_idempotency_key(self, key: str, scope: str, fingerprint: str, object_id: str, now: int) -> None:
        self._idempotency.insert(
            {
                "key": key,
                "scope": scope,
                "fingerprint": fingerprint,
                "object_id": object_id,
                "created_at": now,
            }
        )

    def delete_idempotency_key(self, key: str) -> None:
        self._idempotency.delete_where("key = ?", [key])

    # --- batches ---------------------------------------------------------------------------
    def insert_batch(
        self,
        batch: Batch,
        *,
        idempotency: IdempotencyRecord | None = None,
        files: Sequence[FileObject] = (),
    ) -> None:
        with self._db.atomic():
            for file in files:  # in the same transaction (a nested block is a savepoint)
                self.insert_file(file)
            self._batches.insert({"seq": self._next_seq("batches"), **batch_to_row(batch)})
            self._put_key(idempotency, batch.id)

    def save_batch(self, batch: Batch, *, outbox: Sequence[OutboxMessage] = ()) -> None:
        if not outbox:
            self._batches.update(batch.id, batch_to_row(batch))
            return
        with self._db.atomic():
            self._batches.update(batch.id, batch_to_row(batch))
            self._outbox.insert_all([attrs.asdict(message) for message in outbox], ignore=True)

    # --- webhook outbox --------------------------------------------------------------------
    def due_webhooks(
        self, now: float, limit: int, *, skip_targets: Collection[str] = ()
    ) -> list[OutboxMessage]:
        skipped = sorted(set(skip_targets))
        where = "next_attempt_at <= ?"
        if skipped:
            where += f" AND target NOT IN ({', '.join('?' for _ in skipped)})"
        rows = self._outbox.rows_where(
            where, [now, *skipped], order_by="next_attempt_at, created_at", limit=limit
        )
        return [OutboxMessage(**row) for row in rows]

    def pending_webhooks(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM webhook_outbox").fetchone()[0])

    def reschedule_webhook(self, message: OutboxMessage) -> None:
        self._outbox.update(
            (message.event_id, message.target),
            {
                "attempts": message.attempts,
                "next_attempt_at": message.next_attempt_at,
                "last_error": message.last_error,
            },
        )

    def delete_webhook(self, event_id: str, target: str) -> None:
        self._outbox.delete_where("event_id = ? AND target = ?", [event_id, target])

    def get_batch(self, batch_id: str) -> Batch | None:
        rows = list(self._batches.rows_where("id = ?", [batch_id], limit=1))
        return batch_from_row(rows[0]) if rows else None

    def list_batches(
        self, *, after: str | None, limit: int, descending: bool = True, owner: str | None = None
    ) -> tuple[list[Batch], bool]:
        """Up to ``limit`` batches after the cursor (newest first unless not ``descending``; of
        ``owner`` only, if given), and whether more follow."""
        clauses: list[str] = []
        params: list[Any] = []
        if owner is not None:
            clause, clause_params = owner_clause(owner, "?")
            clauses.append(clause)
            params += clause_params
        if after is not None:
            clauses.append(f"seq {'<' if descending else '>'} ?")
            params.append(self._cursor_seq("batches", after, owner))
        where = " AND ".join(clauses) or None
        order_by = f"seq {'DESC' if descending else 'ASC'}"
        rows = list(self._batches.rows_where(where, params, order_by=order_by, limit=limit + 1))
        return [batch_from_row(row) for row in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[Batch]:
        placeholders = ", ".join("?" for _ in ACTIVE_STATUSES)
        rows = self._batches.rows_where(f"status IN ({placeholders})", list(ACTIVE_STATUSES), order_by="seq")
        return [batch_from_row(row) for row in rows]

    def batches_using_file(self, file_id: str) -> list[Batch]:
        rows = self._batches.rows_where(
            "input_file_id = ? OR output_file_id = ? OR error_file_id = ?",
            [file_id, file_id, file_id],
        )
        return [batch_from_row(row) for row in rows]

    def retries_of(self, batch_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The ids of the batches made as retries of each of ``batch_ids`` (oldest first); a batch
        with none is left out."""
        found: dict[str, list[str]] = {}
        for start in range(0, len(batch_ids), 500):
            chunk = list(batch_ids[start : start + 500])
            placeholders = ", ".join("?" for _ in chunk)
            rows = self._db.execute(
                f"SELECT retry_of, id FROM batches WHERE retry_of IN ({placeholders}) ORDER BY seq", chunk
            ).fetchall()
            for parent, child in rows:
                found.setdefault(parent, []).append(child)
        return {parent: tuple(children) for parent, children in found.items()}

    def retry_family(self, batch_id: str) -> list[str]:
        """``batch_id`` and every batch made as a retry of it or of one of its retries, in the
        order they were created."""
        return [row[0] for row in self._db.execute(*retry_family_query(batch_id, "?")).fetchall()]

    # --- usage -----------------------------------------------------------------------------
    def usage(self, owner: str | None = None) -> list[TenantUsage]:
        """Each owner's batches, finished requests and tokens, from the saved batch counters."""
        return [TenantUsage(*row) for row in self._db.execute(*usage_query(owner, "?")).fetchall()]
