"""PostgresMetadataStore: files, batches, idempotency keys and the webhook outbox in PostgreSQL.

The ``MetadataStore`` protocol (``storage.interfaces``) over psycopg 3 and its connection pool,
for several servers that share one database (``batchgen-core[postgres]``). It holds to the same
contract tests as ``SQLiteMetadataStore`` (``tests/core/test_storage_contract.py``) and uses the
same row layout (``storage.metadata_rows``).

- **Order.** Files and batches take their ``seq`` from a database sequence, so numbers grow with
  creation on every server and are never given twice; a deleted file's id and number stay in
  ``deleted_files``, so a cursor naming it still pages on.
- **Every write is one transaction** (committed at the end of its block, or rolled back when the
  block raises): a file and its Idempotency-Key, a batch and a retry's input file, a batch's
  state and its webhook messages are written together or not at all. Reads run in autocommit:
  one statement, no COMMIT round trip.
- **No call waits long.** The service makes its API's calls from worker threads
  (``calls_block``, ``storage.metadata_calls``), and a write that finds a row or table locked by
  another connection gives up after ``LOCK_TIMEOUT_S``, any statement after
  ``STATEMENT_TIMEOUT_S``, and getting a connection after ``CONNECTION_WAIT_S``;
  ``storage.faults`` turns those errors, and an unreachable or restarting server, into
  ``StorageUnavailable`` (503 with ``Retry-After``).
- **Start.** The schema is made (or columns a newer version added are added) under an advisory
  lock, so servers starting together do not race; a server that cannot be reached within
  ``OPEN_TIMEOUT_S`` fails the start with an error naming the URL without its password.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row, tuple_row
from psycopg_pool import ConnectionPool, PoolTimeout

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
from batchgen.core.storage.postgres_schema import make_schema
from batchgen.core.storage.postgres_uploads import UPLOAD_SCHEMA, PostgresUploadRecords, spend_stored_bytes
from batchgen.core.tenancy import TenantUsage
from batchgen.core.url_redaction import redact_url
from batchgen.core.webhook_outbox import OutboxMessage

#: How long a write waits for a lock another connection holds before failing (a storage fault).
LOCK_TIMEOUT_S = 0.1
#: How long any one statement may run.
STATEMENT_TIMEOUT_S = 5.0
#: How long a call waits for a free connection of the pool.
CONNECTION_WAIT_S = 2.0
#: How long opening the store waits for the first connection, and for the schema lock.
OPEN_TIMEOUT_S = 10.0
#: Connections the store keeps (each server's calls are short and come from one event loop).
POOL_SIZE = 4

_SQL_TYPES = {int: "BIGINT", str: "TEXT", float: "DOUBLE PRECISION", bytes: "BYTEA"}
_SCHEMA_LOCK = 0x6261746368676D64  # "batchgmd": the advisory lock the schema is made under

_FILE_FIELDS = [column for column in FILE_COLUMNS if column != "seq"]
_BATCH_FIELDS = [column for column in BATCH_COLUMNS if column not in {"seq", "id"}]
_OUTBOX_FIELDS = list(OUTBOX_COLUMNS)


def _insert(
    table: str, fields: Sequence[str], *, numbered_by: str | None = None, suffix: str = ""
) -> sql.Composed:
    """``INSERT INTO table (fields) VALUES (placeholders)``, the row's ``seq`` first from the
    sequence ``numbered_by`` when given."""
    names = [sql.Identifier(name) for name in fields]
    values: list[sql.Composable] = [sql.Placeholder()] * len(fields)
    if numbered_by is not None:
        names.insert(0, sql.Identifier("seq"))
        values.insert(0, sql.SQL("nextval({})").format(sql.Literal(numbered_by)))
    return sql.SQL("INSERT INTO {} ({}) VALUES ({}){}").format(
        sql.Identifier(table), sql.SQL(", ").join(names), sql.SQL(", ").join(values), sql.SQL(suffix)
    )


# Built once: the statements each write runs.
_INSERT_FILE = _insert("files", _FILE_FIELDS, numbered_by="file_seq")
_INSERT_BATCH = _insert("batches", ["id", *_BATCH_FIELDS], numbered_by="batch_seq")
_INSERT_OUTBOX = _insert(
    "webhook_outbox", _OUTBOX_FIELDS, suffix=" ON CONFLICT (event_id, target) DO NOTHING"
)
_SAVE_BATCH = sql.SQL("UPDATE batches SET {} WHERE id = %s").format(
    sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(name)) for name in _BATCH_FIELDS)
)


def _columns(columns: dict[str, type], *, skip: Collection[str] = ()) -> list[sql.Composable]:
    return [
        sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(_SQL_TYPES[kind]))
        for name, kind in columns.items()
        if name not in skip
    ]


def _schema() -> list[sql.SQL | sql.Composed]:
    """The statements that make every table, sequence and index (each harmless when it exists)."""
    statements: list[sql.SQL | sql.Composed] = [
        sql.SQL("CREATE SEQUENCE IF NOT EXISTS file_seq"),
        sql.SQL("CREATE SEQUENCE IF NOT EXISTS batch_seq"),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS files (seq BIGINT NOT NULL UNIQUE, id TEXT PRIMARY KEY, {})"
        ).format(sql.SQL(", ").join(_columns(FILE_COLUMNS, skip={"seq", "id"}))),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS deleted_files (id TEXT PRIMARY KEY, seq BIGINT NOT NULL, owner TEXT)"
        ),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS idempotency_keys (key TEXT PRIMARY KEY, scope TEXT NOT NULL, "
            "fingerprint TEXT NOT NULL, object_id TEXT NOT NULL, created_at BIGINT NOT NULL)"
        ),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS batches (seq BIGINT NOT NULL UNIQUE, id TEXT PRIMARY KEY, {})"
        ).format(sql.SQL(", ").join(_columns(BATCH_COLUMNS, skip={"seq", "id"}))),
        sql.SQL("CREATE TABLE IF NOT EXISTS webhook_outbox ({}, PRIMARY KEY (event_id, target))").format(
            sql.SQL(", ").join(_columns(OUTBOX_COLUMNS))
        ),
    ]
    for table, columns in (("files", FILE_COLUMNS), ("batches", BATCH_COLUMNS)):
        for column in _columns(columns, skip={"seq", "id"}):  # columns a newer version added
            statements.append(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {}").format(sql.Identifier(table), column)
            )
    for index in (
        "CREATE INDEX IF NOT EXISTS files_expiry ON files (expires_at) WHERE expires_at IS NOT NULL",
        "CREATE INDEX IF NOT EXISTS files_owner ON files (owner, seq)",
        "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",
        "CREATE INDEX IF NOT EXISTS batches_input ON batches (input_file_id)",
        "CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq)",
        "CREATE INDEX IF NOT EXISTS batches_retry_of ON batches (retry_of)",
        "CREATE INDEX IF NOT EXISTS outbox_due ON webhook_outbox (next_attempt_at)",
    ):
        statements.append(sql.SQL(index))
    statements += [sql.SQL(statement) for statement in UPLOAD_SCHEMA]  # the Uploads API's tables
    return statements


def _configure(connection: psycopg.Connection[Any]) -> None:
    """Each new connection's limits, so no call from the event loop waits long."""
    connection.execute(
        "SELECT set_config('lock_timeout', %s, false), set_config('statement_timeout', %s, false)",
        [f"{int(LOCK_TIMEOUT_S * 1000)}ms", f"{int(STATEMENT_TIMEOUT_S * 1000)}ms"],
    )


class PostgresMetadataStore:
    """Files and batches in the PostgreSQL database at ``url`` (``postgresql://…``)."""

    #: Its calls wait on the network: the service makes them in worker threads (``MetadataCalls``).
    calls_block = True

    def __init__(self, url: str) -> None:
        self._url = url
        self._pool: ConnectionPool[psycopg.Connection[dict[str, Any]]] = ConnectionPool(
            url,
            min_size=1,
            max_size=POOL_SIZE,
            timeout=CONNECTION_WAIT_S,
            kwargs={
                "row_factory": dict_row,
                "autocommit": True,
                "connect_timeout": max(1, int(OPEN_TIMEOUT_S)),
            },
            configure=_configure,
            check=ConnectionPool.check_connection,  # a connection a restart broke is replaced
            open=False,
            name="batchgen-metadata",
        )
        try:
            # one connection first: a server that refuses or is unknown fails the start at once
            # with its own reason (the pool would retry until its timeout), and makes the schema
            with psycopg.connect(url, connect_timeout=max(1, int(OPEN_TIMEOUT_S))) as connection:
                self._make_schema(connection)
            self._pool.open(wait=True, timeout=OPEN_TIMEOUT_S)
        except (PoolTimeout, psycopg.OperationalError) as exc:
            self._pool.close()
            raise ConnectionError(
                f"the metadata database at {redact_url(url)} cannot be used: {exc}"
            ) from exc

    @staticmethod
    def _make_schema(connection: psycopg.Connection[Any]) -> None:
        """Every table, made once under an advisory lock (servers starting together wait on it);
        nothing but a read when ``storage.postgres_schema`` says they are made already."""
        statements = [statement.as_string(connection) for statement in _schema()]
        make_schema(
            connection, "metadata", statements, _SCHEMA_LOCK, lock_timeout_ms=int(OPEN_TIMEOUT_S * 1000)
        )

    def close(self) -> None:
        self._pool.close()

    def try_lock(self, name: str) -> Callable[[], None] | None:
        """The lock ``name``, one for every replica on this database, if none holds it now: the
        function that lets it go; None while another holds it. The lock is a session's advisory
        lock, on a connection kept for it and closed to let it go, so a holder that dies (or
        whose connection breaks) lets it go too, and it never outlives its holder in the pool."""
        connection = self._pool.getconn()
        try:
            row = connection.execute(
                "SELECT pg_try_advisory_lock(hashtextextended(%s, 0)) AS taken", [name]
            ).fetchone()
        except BaseException:
            connection.close()
            self._pool.putconn(connection)
            raise
        if row is None or not row["taken"]:
            self._pool.putconn(connection)
            return None

        def release() -> None:
            connection.close()  # the session ends: its lock with it
            self._pool.putconn(connection)

        return release

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """One connection of the pool for one transaction: committed at the end of the block,
        rolled back when it raises."""
        with self._pool.connection() as connection, connection.transaction():
            yield connection

    def _rows(self, query: str | sql.Composed, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """A read: one statement on a connection in autocommit (no COMMIT round trip)."""
        with self._pool.connection() as connection:
            return connection.execute(query, params).fetchall()

    def _cursor_seq(
        self, connection: psycopg.Connection[dict[str, Any]], table: str, object_id: str, owner: str | None
    ) -> int:
        """The sequence number of the object an ``after`` cursor names, deleted or not; with
        ``owner``, only an object of that owner counts (another's id is refused as unknown)."""
        row = connection.execute(*cursor_seq_query(table, object_id, owner, "%s")).fetchone()
        if row is None:
            raise unknown_cursor(table, object_id)
        return int(row["seq"])

    def _page(
        self,
        table: str,
        clauses: list[str],
        params: list[Any],
        *,
        after: str | None,
        limit: int,
        descending: bool,
        owner: str | None,
    ) -> list[dict[str, Any]]:
        with self._pool.connection() as connection:
            if owner is not None:
                clause, clause_params = owner_clause(owner, "%s")
                clauses.append(clause)
                params += clause_params
            if after is not None:
                clauses.append(f"seq {'<' if descending else '>'} %s")
                params.append(self._cursor_seq(connection, table, after, owner))
            where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
            order = "DESC" if descending else "ASC"
            query = f"SELECT * FROM {table}{where} ORDER BY seq {order} LIMIT %s"
            return connection.execute(query, [*params, limit + 1]).fetchall()

    # --- files -----------------------------------------------------------------------------
    def insert_file(self, file: FileObject, *, idempotency: IdempotencyRecord | None = None) -> None:
        with self._transaction() as connection:
            self._insert_file(connection, file)
            self._put_key(connection, idempotency, file.id)

    def insert_file_within_quota(
        self, file: FileObject, *, max_stored_bytes: int, idempotency: IdempotencyRecord | None = None
    ) -> None:
        """``insert_file``, checked against the owner's ``max_stored_bytes`` in the same
        transaction, under the tenant's lock (``storage.stored_bytes``: StoredBytesExceeded)."""
        with self._transaction() as connection:
            spend_stored_bytes(connection, file.owner, file.bytes, max_stored_bytes)
            self._insert_file(connection, file)
            self._put_key(connection, idempotency, file.id)

    def upload_records(self) -> PostgresUploadRecords:
        """The Uploads API's records, in this database, through this store's connections."""
        return PostgresUploadRecords(self._transaction, self._insert_file)

    @staticmethod
    def _insert_file(connection: psycopg.Connection[dict[str, Any]], file: FileObject) -> None:
        row = file_to_row(file)
        connection.execute("DELETE FROM deleted_files WHERE id = %s", [file.id])  # live again
        connection.execute(_INSERT_FILE, [row[name] for name in _FILE_FIELDS])

    def get_file(self, file_id: str) -> FileObject | None:
        rows = self._rows("SELECT * FROM files WHERE id = %s", [file_id])
        return file_from_row(rows[0]) if rows else None

    def expired_files(self, now: int) -> list[FileObject]:
        rows = self._rows(
            "SELECT * FROM files WHERE expires_at IS NOT NULL AND expires_at <= %s ORDER BY seq", [now]
        )
        return [file_from_row(row) for row in rows]

    def delete_file(self, file_id: str) -> None:
        with self._transaction() as connection:
            connection.execute(
                "INSERT INTO deleted_files (id, seq, owner) SELECT id, seq, owner FROM files "
                "WHERE id = %s ON CONFLICT (id) DO NOTHING",
                [file_id],
            )
            connection.execute("DELETE FROM files WHERE id = %s", [file_id])

    def list_files(
        self,
        *,
        after: str | None,
        limit: int,
        descending: bool,
        purpose: str | None,
        owner: str | None = None,
    ) -> tuple[list[FileObject], bool]:
        clauses, params = ([], []) if purpose is None else (["purpose = %s"], [purpose])
        rows = self._page(
            "files", clauses, params, after=after, limit=limit, descending=descending, owner=owner
        )
        return [file_from_row(row) for row in rows[:limit]], len(rows) > limit

    # --- idempotency keys ------------------------------------------------------------------
    def get_idempotency_key(self, key: str) -> tuple[str, str, str] | None:
        rows = self._rows("SELECT scope, fingerprint, object_id FROM idempotency_keys WHERE key = %s", [key])
        if not rows:
            return None
        return rows[0]["scope"], rows[0]["fingerprint"], rows[0]["object_id"]

    def _put_key(
        self,
        connection: psycopg.Connection[dict[str, Any]],
        record: IdempotencyRecord | None,
        object_id: str,
    ) -> None:
        if record is not None:
            self._insert_key(
                connection, record.key, record.scope, record.fingerprint, object_id, record.created_at
            )

    @staticmethod
    def _insert_key(
        connection: psycopg.Connection[dict[str, Any]],
        key: str,
        scope: str,
        fingerprint: str,
        object_id: str,
        now: int,
    ) -> None:
        connection.execute(
            "INSERT INTO idempotency_keys (key, scope, fingerprint, object_id, created_at) "
            "VALUES (%s, %s, %s, %s, %s)",
            [key, scope, fingerprint, object_id, now],
        )

    def put_idempotency_key(self, key: str, scope: str, fingerprint: str, object_id: str, now: int) -> None:
        with self._transaction() as connection:
            self._insert_key(connection, key, scope, fingerprint, object_id, now)

    def delete_idempotency_key(self, key: str) -> None:
        with self._transaction() as connection:
            connection.execute("DELETE FROM idempotency_keys WHERE key = %s", [key])

    # --- batches ---------------------------------------------------------------------------
    def insert_batch(
        self,
        batch: Batch,
        *,
        idempotency: IdempotencyRecord | None = None,
        files: Sequence[FileObject] = (),
    ) -> None:
        row = batch_to_row(batch)
        with self._transaction() as connection:
            for file in files:
                self._insert_file(connection, file)
            connection.execute(_INSERT_BATCH, [row[name] for name in ("id", *_BATCH_FIELDS)])
            self._put_key(connection, idempotency, batch.id)

    def save_batch(self, batch: Batch, *, outbox: Sequence[OutboxMessage] = ()) -> None:
        row = batch_to_row(batch)
        with self._transaction() as connection:
            connection.execute(_SAVE_BATCH, [*(row[name] for name in _BATCH_FIELDS), batch.id])
            if outbox:
                connection.cursor().executemany(
                    _INSERT_OUTBOX,
                    [[getattr(message, name) for name in _OUTBOX_FIELDS] for message in outbox],
                )

    def get_batch(self, batch_id: str) -> Batch | None:
        rows = self._rows("SELECT * FROM batches WHERE id = %s", [batch_id])
        return batch_from_row(rows[0]) if rows else None

    def list_batches(
        self, *, after: str | None, limit: int, descending: bool = True, owner: str | None = None
    ) -> tuple[list[Batch], bool]:
        rows = self._page("batches", [], [], after=after, limit=limit, descending=descending, owner=owner)
        return [batch_from_row(row) for row in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[Batch]:
        rows = self._rows(
            "SELECT * FROM batches WHERE status = ANY(%s) ORDER BY seq", [list(ACTIVE_STATUSES)]
        )
        return [batch_from_row(row) for row in rows]

    def batches_using_file(self, file_id: str) -> list[Batch]:
        rows = self._rows(
            "SELECT * FROM batches WHERE input_file_id = %s OR output_file_id = %s OR error_file_id = %s "
            "ORDER BY seq",
            [file_id, file_id, file_id],
        )
        return [batch_from_row(row) for row in rows]

    def retries_of(self, batch_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        found: dict[str, list[str]] = {}
        if batch_ids:
            rows = self._rows(
                "SELECT retry_of, id FROM batches WHERE retry_of = ANY(%s) ORDER BY seq", [list(batch_ids)]
            )
            for row in rows:
                found.setdefault(row["retry_of"], []).append(row["id"])
        return {parent: tuple(children) for parent, children in found.items()}

    def retry_family(self, batch_id: str) -> list[str]:
        rows = self._rows(*retry_family_query(batch_id, "%s", text_cast="::text"))
        return [row["id"] for row in rows]

    # --- webhook outbox --------------------------------------------------------------------
    def due_webhooks(
        self, now: float, limit: int, *, skip_targets: Collection[str] = ()
    ) -> list[OutboxMessage]:
        rows = self._rows(
            sql.SQL(
                "SELECT {} FROM webhook_outbox WHERE next_attempt_at <= %s AND NOT (target = ANY(%s)) "
                "ORDER BY next_attempt_at, created_at LIMIT %s"
            ).format(sql.SQL(", ").join(map(sql.Identifier, _OUTBOX_FIELDS))),
            [now, sorted(set(skip_targets)), limit],
        )
        return [OutboxMessage(**row) for row in rows]

    def pending_webhooks(self) -> int:
        return int(self._rows("SELECT COUNT(*) AS pending FROM webhook_outbox")[0]["pending"])

    def reschedule_webhook(self, message: OutboxMessage) -> None:
        with self._transaction() as connection:
            connection.execute(
                "UPDATE webhook_outbox SET attempts = %s, next_attempt_at = %s, last_error = %s "
                "WHERE event_id = %s AND target = %s",
                [
                    message.attempts,
                    message.next_attempt_at,
                    message.last_error,
                    message.event_id,
                    message.target,
                ],
            )

    def delete_webhook(self, event_id: str, target: str) -> None:
        with self._transaction() as connection:
            connection.execute(
                "DELETE FROM webhook_outbox WHERE event_id = %s AND target = %s", [event_id, target]
            )

    # --- usage -----------------------------------------------------------------------------
    def usage(self, owner: str | None = None) -> list[TenantUsage]:
        query, params = usage_query(owner, "%s", integer_cast="::bigint")
        with self._pool.connection() as connection:
            cursor = connection.cursor(row_factory=tuple_row)
            return [TenantUsage(*row) for row in cursor.execute(query, params).fetchall()]
