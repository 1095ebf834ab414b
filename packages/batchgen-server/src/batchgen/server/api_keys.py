"""API keys and tenants, kept in the server's metadata database (``{storage}/metadata.sqlite3``).

A key is ``bg-<key id>-<secret>``: the key id (12 hex digits) names the row, the secret (64 hex
digits, 256 random bits) is never stored, only its SHA-256 digest (a slow hash adds nothing for
a random secret of that length), compared with ``hmac.compare_digest``. A tenant row holds the
tenant's limits and weight; a key belongs to one tenant and may be an admin key.

``KeyStore`` is used both by the ``batchgen-server keys`` command (another process) and by the
running server, which answers from an in-memory copy of the rows and reloads it only when the
database changed: ``PRAGMA data_version`` (no disk read) tells it another connection committed,
and a version counter that every key and tenant change bumps tells it the keys are what changed.
So a revoked key stops working on the next request, at no per-request query cost.

No request waits for the database's write lock. ``last_used_at`` is written at most once a minute
per key, and never on the request path: ``authenticate`` notes the time, and the server saves the
times noted so far once a second (``save_last_use``, a maintenance job on the event loop) in one
short transaction that never waits: while another process holds the database locked, the times
stay noted for a later save. The server has no second writing connection of its own, so its own
writes never find the database locked by itself (a writer thread preempted inside its transaction
on a busy machine made uploads 503). The connection the server reads with has a short busy
timeout; if a read cannot be made (the database locked in a way that stops readers too), the
server keeps answering from the rows it loaded last. The key commands' own changes wait up to
``CHANGE_BUSY_TIMEOUT_S`` for a lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import attrs

from batchgen.core.storage.faults import storage_fault
from batchgen.core.tenancy import Caller, TenantLimits, reserved_tenant_problem

logger = logging.getLogger("batchgen.server")

KEY_PREFIX = "bg-"
_KEY_FORMAT = re.compile(r"^bg-([0-9a-f]{12})-([0-9a-f]{64})$")
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
#: Seconds between two writes of one key's ``last_used_at``.
LAST_USED_WRITE_INTERVAL_S = 60
#: How long a read of the server's (on the event loop) waits for another connection's lock.
READ_BUSY_TIMEOUT_S = 0.05
#: How long a change made by the key commands (and ``list_keys``'s save) waits for a lock.
CHANGE_BUSY_TIMEOUT_S = 30.0
#: Seconds between the server's saves of the last-use times noted (``save_last_use``).
LAST_USED_SAVE_INTERVAL_S = 1.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    max_queued_requests INTEGER,
    max_active_batches INTEGER,
    weight REAL NOT NULL DEFAULT 1.0,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    admin INTEGER NOT NULL DEFAULT 0,
    secret_sha256 TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    last_used_at INTEGER,
    revoked_at INTEGER
);
CREATE TABLE IF NOT EXISTS api_keys_version (id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL);
INSERT OR IGNORE INTO api_keys_version (id, version) VALUES (1, 0);
"""


def check_tenant_name(name: str) -> str:
    """The name, or ValueError saying what a tenant name may hold."""
    if not _TENANT_NAME.match(name):
        raise ValueError(
            f"tenant name {name!r} must be 1-64 letters, digits, '.', '_', '@' or '-', starting with a "
            "letter or digit"
        )
    reserved = reserved_tenant_problem(name)
    if reserved is not None:
        raise ValueError(reserved)
    return name


def secret_digest(secret: str) -> str:
    """The SHA-256 digest a key's secret is stored as (the secret itself never is)."""
    return hashlib.sha256(secret.encode()).hexdigest()


@attrs.frozen
class KeyRecord:
    """One API key as stored (never its secret)."""

    id: str
    tenant: str
    admin: bool
    created_at: int
    last_used_at: int | None
    revoked_at: int | None
    secret_sha256: str = attrs.field(repr=False)


@attrs.frozen
class TenantRecord:
    name: str
    limits: TenantLimits
    created_at: int


class KeyRows:
    """The keys and tenants a server checks requests against, held in memory, and the last uses
    it noted that its store has not saved yet. Both key stores keep one; nothing here reads a
    database, so a request is checked in microseconds whatever the database is doing."""

    def __init__(self) -> None:
        self.keys: dict[str, KeyRecord] = {}
        self.tenants: dict[str, TenantRecord] = {}
        self._last_written: dict[str, int] = {}
        self._unsaved_use: dict[str, int] = {}  # key id -> last use noted, not yet saved
        self._lock = threading.Lock()  # the Postgres store saves the noted uses from its thread

    def replace(self, keys: Iterable[KeyRecord], tenants: Iterable[TenantRecord]) -> None:
        self.keys = {key.id: key for key in keys}
        self.tenants = {tenant.name: tenant for tenant in tenants}

    def limits(self) -> dict[str, TenantLimits]:
        return {name: record.limits for name, record in self.tenants.items()}

    def caller(self, presented: str) -> Caller | None:
        """The caller ``presented`` stands for, or None; a use of a valid key is noted."""
        match = _KEY_FORMAT.match(presented)
        # the digest is computed and compared whatever the key id, so timing says nothing
        digest = secret_digest(match.group(2) if match else presented)
        key = self.keys.get(match.group(1)) if match else None
        stored = key.secret_sha256 if key is not None else secret_digest("")
        if not hmac.compare_digest(digest, stored) or key is None or key.revoked_at is not None:
            return None
        self._note_use(key.id)
        tenant = self.tenants.get(key.tenant)
        limits = tenant.limits if tenant is not None else TenantLimits()
        return Caller(key.tenant, admin=key.admin, limits=limits)

    def _note_use(self, key_id: str) -> None:
        moment = int(time.time())
        if moment - self._last_written.get(key_id, 0) < LAST_USED_WRITE_INTERVAL_S:
            return
        self._last_written[key_id] = moment
        with self._lock:
            self._unsaved_use[key_id] = max(moment, self._unsaved_use.get(key_id, moment))

    def unsaved_use(self) -> dict[str, int]:
        """The last uses noted and not saved yet (a copy)."""
        with self._lock:
            return dict(self._unsaved_use)

    def use_saved(self, saved: dict[str, int]) -> bool:
        """Forget the uses ``saved`` holds (those noted again since stay); whether none is left."""
        with self._lock:
            for key_id, moment in saved.items():
                if self._unsaved_use.get(key_id) == moment:
                    del self._unsaved_use[key_id]
            return not self._unsaved_use


class KeyStore:
    """Keys and tenants in the SQLite database at ``path`` (created if missing)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            str(path), check_same_thread=False, isolation_level=None, timeout=CHANGE_BUSY_TIMEOUT_S
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(tenants)")}
        if "max_stored_bytes" not in columns:  # a database made before the Uploads API
            self._db.execute("ALTER TABLE tenants ADD COLUMN max_stored_bytes INTEGER")
        self._db.execute(f"PRAGMA busy_timeout = {int(READ_BUSY_TIMEOUT_S * 1000)}")
        self._data_version = -1
        self._keys_version = -1
        self._rows = KeyRows()
        self._stale = False  # the last reload failed: answering from the rows loaded before
        #: Called with every tenant's limits whenever the rows are (re)loaded.
        self.on_reload: Callable[[dict[str, TenantLimits]], object] | None = None

    def close(self) -> None:
        self.save_last_use()  # what cannot be saved now is dropped: last use is a hint
        self._db.close()

    # --- changes (the ``keys`` command) ------------------------------------------------------
    @contextlib.contextmanager
    def _change(self) -> Iterator[None]:
        """One transaction of the key commands, which may wait for a lock (they run off any loop)."""
        self._db.execute(f"PRAGMA busy_timeout = {int(CHANGE_BUSY_TIMEOUT_S * 1000)}")
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                yield
        finally:
            self._db.execute(f"PRAGMA busy_timeout = {int(READ_BUSY_TIMEOUT_S * 1000)}")

    def _bump(self) -> None:
        self._db.execute("UPDATE api_keys_version SET version = version + 1 WHERE id = 1")

    def create_key(
        self, tenant: str, *, admin: bool = False, limits: TenantLimits | None = None
    ) -> tuple[str, str]:
        """Make a key for ``tenant`` (made with ``limits`` if new; given limits replace its old
        ones); return (key id, the key). The key is shown once and cannot be recovered."""
        check_tenant_name(tenant)
        key_id = secrets.token_hex(6)
        secret = secrets.token_hex(32)
        created = int(time.time())
        with self._change():
            self._db.execute(
                "INSERT OR IGNORE INTO tenants (name, weight, created_at) VALUES (?, 1.0, ?)",
                (tenant, created),
            )
            if limits is not None:
                self._set_limits(tenant, limits)
            self._db.execute(
                "INSERT INTO api_keys (id, tenant, admin, secret_sha256, created_at) VALUES (?, ?, ?, ?, ?)",
                (key_id, tenant, int(admin), secret_digest(secret), created),
            )
            self._bump()
        return key_id, f"{KEY_PREFIX}{key_id}-{secret}"

    def _set_limits(self, tenant: str, limits: TenantLimits) -> None:
        self._db.execute(
            "UPDATE tenants SET max_queued_requests = ?, max_active_batches = ?, weight = ?, "
            "max_stored_bytes = ? WHERE name = ?",
            (
                limits.max_queued_requests,
                limits.max_active_batches,
                limits.weight,
                limits.max_stored_bytes,
                tenant,
            ),
        )

    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        """Replace a tenant's limits and weight; KeyError if there is no such tenant."""
        with self._change():
            if self._db.execute("SELECT 1 FROM tenants WHERE name = ?", (tenant,)).fetchone() is None:
                raise KeyError(tenant)
            self._set_limits(tenant, limits)
            self._bump()

    def revoke(self, key_id: str) -> bool:
        """Revoke a key; False if no key has that id (or it was revoked already)."""
        key_id = key_id.removeprefix(KEY_PREFIX)
        with self._change():
            changed = self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                (int(time.time()), key_id),
            ).rowcount
            self._bump()
        return bool(changed)

    # --- reading ---------------------------------------------------------------------------
    def list_keys(self) -> list[KeyRecord]:
        """Every key, with the last-use times noted so far saved first (waiting for a lock)."""
        self.save_last_use(wait=True)
        return self._read_keys()

    def _read_keys(self) -> list[KeyRecord]:
        rows = self._db.execute(
            "SELECT id, tenant, admin, created_at, last_used_at, revoked_at, secret_sha256 FROM api_keys "
            "ORDER BY created_at, id"
        ).fetchall()
        return [KeyRecord(row[0], row[1], bool(row[2]), *row[3:]) for row in rows]

    def tenants(self) -> list[TenantRecord]:
        rows = self._db.execute(
            "SELECT name, max_queued_requests, max_active_batches, weight, created_at, max_stored_bytes "
            "FROM tenants ORDER BY name"
        ).fetchall()
        return [TenantRecord(row[0], TenantLimits(row[1], row[2], row[3], row[5]), row[4]) for row in rows]

    def has_keys(self) -> bool:
        """Whether any key was ever made (then every /v1 call needs a valid one). Revoking every
        key does not open the server again: it refuses everyone until a new key is made."""
        self._refresh()
        return bool(self._rows.keys)

    def tenant_limits(self) -> dict[str, TenantLimits]:
        self._refresh()
        return self._rows.limits()

    def _refresh(self) -> bool:
        """Reload the rows if another connection changed them since; True if it reloaded. If the
        database cannot be read now, the rows loaded last are kept (none loaded yet: the storage
        fault is raised, a 503)."""
        try:
            data_version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if data_version == self._data_version:
                return False
            keys_version = self._db.execute("SELECT version FROM api_keys_version WHERE id = 1").fetchone()[0]
            if keys_version == self._keys_version:
                self._data_version = data_version
                return False
            keys, tenants = self._read_keys(), self.tenants()
        except sqlite3.Error as exc:
            if self._keys_version == -1:
                fault = storage_fault(exc, "read the API keys")
                if fault is None:
                    raise
                raise fault from exc
            if not self._stale:
                logger.warning("API keys not reloaded, answering from the rows loaded last: %s", exc)
            self._stale = True
            return False
        self._stale = False
        self._data_version, self._keys_version = data_version, keys_version
        self._rows.replace(keys, tenants)
        if self.on_reload is not None:
            self.on_reload(self._rows.limits())
        return True

    def authenticate(self, presented: str, *, refresh: bool = True) -> Caller | None:
        """The caller a presented key stands for, or None if it is unknown, malformed or revoked
        (``refresh=False``: the caller has just checked for changes, with ``has_keys``)."""
        if refresh:
            self._refresh()
        return self._rows.caller(presented)

    def save_last_use(self, *, wait: bool = False) -> bool:
        """Save the last-use times noted since the last save, in one short transaction; whether
        none is left unsaved. Without ``wait`` (the server, on its event loop) a database another
        connection holds locked is not waited for: the times stay noted for the next save."""
        batch = self._rows.unsaved_use()
        if not batch:
            return True
        self._db.execute(f"PRAGMA busy_timeout = {int(CHANGE_BUSY_TIMEOUT_S * 1000) if wait else 0}")
        self._db.execute("PRAGMA synchronous = NORMAL")  # WAL: this commit makes no fsync (a hint)
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany(
                    "UPDATE api_keys SET last_used_at = MAX(COALESCE(last_used_at, 0), ?) WHERE id = ?",
                    [(moment, key_id) for key_id, moment in batch.items()],
                )
        except sqlite3.Error as exc:
            logger.debug("last use of %d API key(s) not saved yet: %s", len(batch), exc)
            return False
        finally:
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute(f"PRAGMA busy_timeout = {int(READ_BUSY_TIMEOUT_S * 1000)}")
        return self._rows.use_saved(batch)


class ApiKeys(Protocol):
    """What the server and the ``keys`` command use of a key store: ``KeyStore`` (SQLite, one
    server) or ``postgres_api_keys.PostgresKeyStore`` (the database replicas share)."""

    on_reload: Callable[[dict[str, TenantLimits]], object] | None

    def create_key(
        self, tenant: str, *, admin: bool = False, limits: TenantLimits | None = None
    ) -> tuple[str, str]: ...
    def set_limits(self, tenant: str, limits: TenantLimits) -> None: ...
    def revoke(self, key_id: str) -> bool: ...
    def list_keys(self) -> list[KeyRecord]: ...
    def tenants(self) -> list[TenantRecord]: ...
    def has_keys(self) -> bool: ...
    def authenticate(self, presented: str, *, refresh: bool = True) -> Caller | None: ...
    def save_last_use(self, *, wait: bool = False) -> bool: ...
    def close(self) -> None: ...


def open_key_store(
    storage_path: Path,
    metadata_url: str | None = None,
    *,
    on_reload: Callable[[dict[str, TenantLimits]], object] | None = None,
    watch: bool = False,
) -> ApiKeys:
    """The keys of a server: in the database replicas share when it has a ``metadata_url``,
    else in its storage folder's SQLite file; ``on_reload`` set. ``watch`` (a running server):
    the shared database's store reloads and saves last uses from a thread of its own. RuntimeError
    when PostgreSQL's driver is missing."""
    if metadata_url is None:
        store = KeyStore(storage_path / "metadata.sqlite3")
        store.on_reload = on_reload
        return store
    try:
        from batchgen.server.postgres_api_keys import PostgresKeyStore
    except ImportError as exc:
        raise RuntimeError(
            f"--metadata-url needs PostgreSQL's driver ({exc}): pip install 'batchgen-server[postgres]'"
        ) from None
    shared = PostgresKeyStore(metadata_url)
    shared.on_reload = on_reload
    if watch:
        shared.watch()
    return shared
