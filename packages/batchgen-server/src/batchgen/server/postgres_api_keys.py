"""API keys and tenants in PostgreSQL, shared by every replica (``PostgresKeyStore``).

The same keys, tenants and rules as ``api_keys.KeyStore`` (the key format, the hashed secret,
``check_tenant_name``, the in-memory ``KeyRows`` every request is checked against), for servers
that share one database. What differs is how a server learns of changes and saves last uses
without a database call on its event loop:

- **Nothing on the request path reads the database.** ``authenticate``, ``has_keys`` and
  ``tenant_limits`` answer from the rows in memory. A thread of the store (``watch``) reads the
  version counter every ``REFRESH_INTERVAL_S``, loads the rows when another replica (or the
  ``keys`` command) changed them, and leaves them for the event loop, which takes them at its next
  check (and calls ``on_reload`` there, never from the thread). So a revoked key stops working on
  every replica within about ``REFRESH_INTERVAL_S``.
- **Last uses are saved by that thread**, once per interval, in one short transaction; a failed
  save keeps them noted for the next.
- **While the database cannot be read**, every replica keeps answering from the rows it loaded
  last (logged once); a revocation made meanwhile is seen once the database answers again.
- Without ``watch`` (the ``keys`` command, tests) each check reads the database directly, as the
  command runs off any event loop.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from batchgen.core.storage.postgres_schema import make_schema
from batchgen.core.tenancy import Caller, TenantLimits
from batchgen.core.url_redaction import redact_url
from batchgen.server.api_keys import (
    KEY_PREFIX,
    KeyRecord,
    KeyRows,
    TenantRecord,
    check_tenant_name,
    secret_digest,
)

logger = logging.getLogger("batchgen.server")

#: Seconds between two looks of the watching thread at the version counter (and saves of uses).
REFRESH_INTERVAL_S = 0.5
#: How long opening the store waits for the database, and any one statement may run.
OPEN_TIMEOUT_S = 10.0
STATEMENT_TIMEOUT_S = 5.0
_SCHEMA_LOCK = 0x626174636867616B  # "batchgak": the advisory lock the key tables are made under

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY, max_queued_requests BIGINT, "
    "max_active_batches BIGINT, weight DOUBLE PRECISION NOT NULL DEFAULT 1.0, created_at BIGINT NOT NULL, "
    "max_stored_bytes BIGINT)",
    "CREATE TABLE IF NOT EXISTS api_keys (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
    "admin BOOLEAN NOT NULL DEFAULT FALSE, secret_sha256 TEXT NOT NULL, created_at BIGINT NOT NULL, "
    "last_used_at BIGINT, revoked_at BIGINT)",
    "CREATE TABLE IF NOT EXISTS api_keys_version (id INTEGER PRIMARY KEY CHECK (id = 1), "
    "version BIGINT NOT NULL)",
    "INSERT INTO api_keys_version (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
)


def _configure(connection: psycopg.Connection[Any]) -> None:
    connection.execute(
        "SELECT set_config('statement_timeout', %s, false)", [f"{int(STATEMENT_TIMEOUT_S * 1000)}ms"]
    )


class PostgresKeyStore:
    """Keys and tenants in the PostgreSQL database at ``url``; ``watch()`` for a running server."""

    def __init__(self, url: str, *, refresh_interval_s: float = REFRESH_INTERVAL_S) -> None:
        self._refresh_interval_s = refresh_interval_s
        self._pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            url,
            min_size=1,
            max_size=2,
            timeout=OPEN_TIMEOUT_S,
            kwargs={"autocommit": True, "connect_timeout": max(1, int(OPEN_TIMEOUT_S))},
            configure=_configure,
            check=ConnectionPool.check_connection,
            open=False,
            name="batchgen-api-keys",
        )
        try:
            with psycopg.connect(url, connect_timeout=max(1, int(OPEN_TIMEOUT_S))) as connection:
                make_schema(connection, "api_keys", _SCHEMA, _SCHEMA_LOCK)
            self._pool.open(wait=True, timeout=OPEN_TIMEOUT_S)
        except (PoolTimeout, psycopg.OperationalError) as exc:
            self._pool.close()
            raise ConnectionError(f"the API key database at {redact_url(url)} cannot be used: {exc}") from exc
        self._rows = KeyRows()
        self._version = -1
        self._loaded: tuple[int, list[KeyRecord], list[TenantRecord]] | None = None  # the thread's
        self._loaded_lock = threading.Lock()
        self._stale = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        #: Called (on the caller's thread) with every tenant's limits whenever the rows change.
        self.on_reload: Callable[[dict[str, TenantLimits]], object] | None = None

    def watch(self) -> None:
        """Look for changes and save last uses from a thread of the store from now on, so that no
        check of a key reads the database (a running server calls this once)."""
        if self._watcher is None:
            self._load_now()  # here, so that ``on_reload`` sees the first rows on this thread
            self._watcher = threading.Thread(target=self._watch, name="batchgen-api-keys", daemon=True)
            self._watcher.start()

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=OPEN_TIMEOUT_S)
        self.save_last_use(wait=True)  # what cannot be saved now is dropped: last use is a hint
        self._pool.close()

    # --- the database ------------------------------------------------------------------------
    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[Any]]:
        with self._pool.connection() as connection, connection.transaction():
            yield connection

    def _read(self) -> tuple[int, list[KeyRecord], list[TenantRecord]] | None:
        """The rows, if the version differs from the one loaded last; None if it does not."""
        with self._pool.connection() as connection:
            row = connection.execute("SELECT version FROM api_keys_version WHERE id = 1").fetchone()
            version = -1 if row is None else int(row[0])
            if version == self._version:
                return None
            return version, self._keys_of(connection), self._tenants_of(connection)

    @staticmethod
    def _keys_of(connection: psycopg.Connection[Any]) -> list[KeyRecord]:
        rows = connection.execute(
            "SELECT id, tenant, admin, created_at, last_used_at, revoked_at, secret_sha256 FROM api_keys "
            "ORDER BY created_at, id"
        ).fetchall()
        return [KeyRecord(*row) for row in rows]

    @staticmethod
    def _tenants_of(connection: psycopg.Connection[Any]) -> list[TenantRecord]:
        rows = connection.execute(
            "SELECT name, max_queued_requests, max_active_batches, weight, created_at, max_stored_bytes "
            "FROM tenants ORDER BY name"
        ).fetchall()
        return [TenantRecord(row[0], TenantLimits(row[1], row[2], row[3], row[5]), row[4]) for row in rows]

    def _load_now(self) -> None:
        loaded = self._read()
        if loaded is not None:
            self._take(loaded)

    def _take(self, loaded: tuple[int, list[KeyRecord], list[TenantRecord]]) -> None:
        self._version = loaded[0]
        self._rows.replace(loaded[1], loaded[2])
        if self.on_reload is not None:
            self.on_reload(self._rows.limits())

    def _watch(self) -> None:
        while not self._stop.wait(self._refresh_interval_s):
            try:
                loaded = self._read()
            except (psycopg.Error, PoolTimeout) as exc:
                if not self._stale:
                    logger.warning("API keys not reloaded, answering from the rows loaded last: %s", exc)
                self._stale = True
                continue
            if self._stale:
                logger.info("API keys can be read again")
                self._stale = False
            if loaded is not None:
                with self._loaded_lock:
                    self._loaded = loaded
            self.save_last_use(wait=True)

    def _refresh(self) -> None:
        """Take the rows the thread loaded (watching), or read them now (not watching)."""
        if self._watcher is None:
            self._load_now()
            return
        with self._loaded_lock:
            loaded, self._loaded = self._loaded, None
        if loaded is not None and loaded[0] != self._version:
            self._take(loaded)

    # --- changes (the ``keys`` command) ------------------------------------------------------
    def create_key(
        self, tenant: str, *, admin: bool = False, limits: TenantLimits | None = None
    ) -> tuple[str, str]:
        """Make a key for ``tenant`` (made with ``limits`` if new; given limits replace its old
        ones); return (key id, the key). The key is shown once and cannot be recovered."""
        check_tenant_name(tenant)
        key_id, secret, created = secrets.token_hex(6), secrets.token_hex(32), int(time.time())
        with self._transaction() as connection:
            connection.execute(
                "INSERT INTO tenants (name, weight, created_at) VALUES (%s, 1.0, %s) ON CONFLICT DO NOTHING",
                [tenant, created],
            )
            if limits is not None:
                self._set_limits(connection, tenant, limits)
            connection.execute(
                "INSERT INTO api_keys (id, tenant, admin, secret_sha256, created_at) VALUES (%s, %s, %s, %s, %s)",
                [key_id, tenant, admin, secret_digest(secret), created],
            )
            self._bump(connection)
        return key_id, f"{KEY_PREFIX}{key_id}-{secret}"

    @staticmethod
    def _bump(connection: psycopg.Connection[Any]) -> None:
        connection.execute("UPDATE api_keys_version SET version = version + 1 WHERE id = 1")

    @staticmethod
    def _set_limits(connection: psycopg.Connection[Any], tenant: str, limits: TenantLimits) -> None:
        connection.execute(
            "UPDATE tenants SET max_queued_requests = %s, max_active_batches = %s, weight = %s, "
            "max_stored_bytes = %s WHERE name = %s",
            [
                limits.max_queued_requests,
                limits.max_active_batches,
                limits.weight,
                limits.max_stored_bytes,
                tenant,
            ],
        )

    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        """Replace a tenant's limits and weight; KeyError if there is no such tenant."""
        with self._transaction() as connection:
            if connection.execute("SELECT 1 FROM tenants WHERE name = %s", [tenant]).fetchone() is None:
                raise KeyError(tenant)
            self._set_limits(connection, tenant, limits)
            self._bump(connection)

    def revoke(self, key_id: str) -> bool:
        """Revoke a key; False if no key has that id (or it was revoked already)."""
        with self._transaction() as connection:
            changed = connection.execute(
                "UPDATE api_keys SET revoked_at = %s WHERE id = %s AND revoked_at IS NULL",
                [int(time.time()), key_id.removeprefix(KEY_PREFIX)],
            ).rowcount
            self._bump(connection)
        return bool(changed)

    # --- reading -----------------------------------------------------------------------------
    def list_keys(self) -> list[KeyRecord]:
        """Every key, with the last-use times noted so far saved first."""
        self.save_last_use(wait=True)
        with self._pool.connection() as connection:
            return self._keys_of(connection)

    def tenants(self) -> list[TenantRecord]:
        with self._pool.connection() as connection:
            return self._tenants_of(connection)

    def has_keys(self) -> bool:
        """Whether any key was ever made (then every /v1 call needs a valid one)."""
        self._refresh()
        return bool(self._rows.keys)

    def tenant_limits(self) -> dict[str, TenantLimits]:
        self._refresh()
        return self._rows.limits()

    def authenticate(self, presented: str, *, refresh: bool = True) -> Caller | None:
        """The caller a presented key stands for, or None if it is unknown, malformed or revoked."""
        if refresh:
            self._refresh()
        return self._rows.caller(presented)

    def save_last_use(self, *, wait: bool = False) -> bool:
        """Save the last-use times noted so far; whether none is left unsaved. Watching, a call
        without ``wait`` (the server's event loop) leaves the save to the store's thread."""
        batch = self._rows.unsaved_use()
        if not batch:
            return True
        if self._watcher is not None and not wait:
            return False
        try:
            with self._transaction() as connection, connection.cursor() as cursor:
                cursor.executemany(
                    "UPDATE api_keys SET last_used_at = GREATEST(COALESCE(last_used_at, 0), %s) WHERE id = %s",
                    [(moment, key_id) for key_id, moment in batch.items()],
                )
        except (psycopg.Error, PoolTimeout) as exc:
            logger.debug("last use of %d API key(s) not saved yet: %s", len(batch), exc)
            return False
        return self._rows.use_saved(batch)
