"""The result cache: successful response bodies of deterministic requests, kept to be replayed.

It is opt-in per tenant (``ResultCacheSettings.tenants``; ``"*"`` names every tenant) and lives in
its own SQLite file in the storage folder (``result_cache.sqlite3``), so it survives a restart. A
server that names no tenant never opens or creates the file.

Each entry is one response body exactly as it was written in the first run's output line, with
its token counts, under the key ``result_cache_keys.cache_key`` made (the tenant is part of it).
The store is bounded by ``max_bytes`` (the bodies and keys) and ``max_entries``; whenever a write
would pass either, the least recently used entries (a hit counts as a use) are evicted in the
same transaction, so the file never holds more than its bound. Only the executor's successful
results are stored, never an error. The event loop only reads the file: new entries and uses
wait in memory (where lookups see them) and are written in a worker thread (``flush``).

The cache only saves work: a call that fails (a full disk, a damaged file) is logged once and
treated as a miss or a store left out, and the batch goes on as without a cache.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import attrs

logger = logging.getLogger("batchgen.service")

FILE_NAME = "result_cache.sqlite3"
#: Every tenant (``ResultCacheSettings.tenants``).
ALL_TENANTS = "*"
#: Defaults of the bounds (``--result-cache-max-bytes``, ``--result-cache-max-entries``).
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MAX_ENTRIES = 1_000_000
#: What an entry counts besides its body and key (its row and index entries, roughly).
ENTRY_OVERHEAD_BYTES = 64
#: Seconds between writes of the entries and uses that wait in memory (``ResultCache.flush``).
FLUSH_INTERVAL_S = 0.2
#: Keys looked up per query (SQLite's default limit of bound parameters is far above this).
_LOOKUP_CHUNK = 500


def _tenants(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.frozen
class ResultCacheSettings:
    """Which tenants use the cache, and its bounds."""

    tenants: tuple[str, ...] = attrs.field(default=(), converter=_tenants)
    max_bytes: int = attrs.field(default=DEFAULT_MAX_BYTES, validator=_positive)
    max_entries: int = attrs.field(default=DEFAULT_MAX_ENTRIES, validator=_positive)

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)


@attrs.frozen
class CachedResult:
    """A stored response body (the JSON bytes of the first run's ``response.body``) and its tokens."""

    body: bytes
    prompt_tokens: int
    completion_tokens: int


@attrs.define
class CacheCounts:
    """What the cache did since the service started (``/metrics``)."""

    hits: int = 0
    misses: int = 0
    saved_prompt_tokens: int = 0
    saved_completion_tokens: int = 0
    stored: int = 0
    evicted: int = 0


def entry_size(key: str, body: bytes) -> int:
    """What one entry counts against ``max_bytes``."""
    return len(body) + len(key) + ENTRY_OVERHEAD_BYTES


class ResultCache:
    """The cache's SQLite file.

    ``lookup``, ``store_later`` and ``served`` are called on the event loop's thread and do no
    write: the entries to store and the uses to record wait in memory (a lookup sees them) until
    ``flush`` writes them, in a worker thread and one transaction, every ``FLUSH_INTERVAL_S``
    (a maintenance job of the service) and at ``close``. A kill loses at most what waited, which
    the next identical request computes again. ``store`` writes at once.
    """

    def __init__(self, path: Path, settings: ResultCacheSettings) -> None:
        self.settings = settings
        self.path = path
        self.counts = CacheCounts()
        self._tenants = frozenset(settings.tenants)
        self._db = self._connect()  # reads, on the event loop's thread
        self._writer = self._connect()  # writes, under ``_lock``
        self._lock = threading.Lock()
        self._writer.execute(
            "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
            "body BLOB NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
            "size INTEGER NOT NULL, last_used INTEGER NOT NULL)"
        )
        self._writer.execute("CREATE INDEX IF NOT EXISTS entries_last_used ON entries (last_used)")
        count, total, last = self._writer.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(MAX(last_used), 0) FROM entries"
        ).fetchone()
        #: Entries and the bytes they count, kept equal to the file's.
        self.entries: int = count
        self.bytes: int = total
        self._clock: int = last
        self._failing = False
        #: Entries to store and keys used since the last flush, and those the running flush writes.
        self._pending: dict[str, tuple[str, CachedResult]] = {}
        self._touched: dict[str, None] = {}
        self._writing: dict[str, tuple[str, CachedResult]] = {}
        with self._lock, _Transaction(self._writer):  # the bounds may be lower than when it was filled
            self._evict()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=5.0)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    @property
    def waiting(self) -> int:
        """Entries stored in memory and not yet in the file."""
        return len(self._pending) + len(self._writing)

    def close(self) -> None:
        """Write what waits, then close the file."""
        pending, touched = self._take()
        self._write(pending, touched)
        self._db.close()
        self._writer.close()

    def enabled_for(self, tenant: str) -> bool:
        """Whether ``tenant``'s requests use the cache."""
        return ALL_TENANTS in self._tenants or tenant in self._tenants

    def lookup(self, keys: Sequence[str]) -> dict[str, CachedResult]:
        """The entries of ``keys`` that are stored or wait to be (each marked used); a key not
        returned is a miss, and counted so; hits are counted by ``served`` once their lines are
        written."""
        found: dict[str, CachedResult] = {}
        unique: list[str] = []
        for key in dict.fromkeys(keys):
            waiting = self._pending.get(key) or self._writing.get(key)
            if waiting is not None:
                found[key] = waiting[1]
            else:
                unique.append(key)
        try:
            for start in range(0, len(unique), _LOOKUP_CHUNK):
                chunk = unique[start : start + _LOOKUP_CHUNK]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(
                    f"SELECT key, body, prompt_tokens, completion_tokens FROM entries WHERE key IN ({marks})",
                    chunk,
                ).fetchall()
                for key, body, prompt_tokens, completion_tokens in rows:
                    found[key] = CachedResult(bytes(body), prompt_tokens, completion_tokens)
                    self._touched.pop(key, None)  # the latest use last
                    self._touched[key] = None
            self._recovered()
        except sqlite3.Error as exc:
            self._fault("look up", exc)
        self.counts.misses += sum(1 for key in keys if key not in found)
        return found

    def served(self, result: CachedResult) -> None:
        """A hit's line was written: count what it saved."""
        self.counts.hits += 1
        self.counts.saved_prompt_tokens += result.prompt_tokens
        self.counts.saved_completion_tokens += result.completion_tokens

    def store_later(self, entries: Iterable[tuple[str, str, CachedResult]]) -> None:
        """Keep ``(key, tenant, result)`` entries to be written by the next ``flush``."""
        for key, tenant, result in entries:
            if key not in self._writing:
                self._pending.setdefault(key, (tenant, result))

    def store(self, entries: Iterable[tuple[str, str, CachedResult]]) -> None:
        """Store ``(key, tenant, result)`` entries now, in one transaction (see ``_write``)."""
        self._write({key: (tenant, result) for key, tenant, result in entries}, {})

    async def flush(self) -> None:
        """Write what waits, in a worker thread (the service's maintenance job)."""
        pending, touched = self._take()
        if not pending and not touched:
            return
        self._writing = pending
        try:
            await anyio.to_thread.run_sync(self._write, pending, touched)
        finally:
            self._writing = {}

    def _take(self) -> tuple[dict[str, tuple[str, CachedResult]], dict[str, None]]:
        pending, touched = self._pending, self._touched
        self._pending, self._touched = {}, {}
        return pending, touched

    def _write(self, pending: dict[str, tuple[str, CachedResult]], touched: dict[str, None]) -> None:
        """Record the uses, insert the entries (an entry larger than ``max_bytes`` by itself is
        left out; a key stored already keeps its entry) and evict the least recently used as the
        bounds require, all in one transaction. A failure is logged, and what it held is dropped."""
        rows = [
            (key, tenant, result, entry_size(key, result.body))
            for key, (tenant, result) in pending.items()
            if entry_size(key, result.body) <= self.settings.max_bytes
        ]
        if not rows and not touched:
            return
        with self._lock:
            entries_before, bytes_before, clock_before = self.entries, self.bytes, self._clock
            db = self._writer
            try:
                with _Transaction(db):
                    if touched:
                        db.executemany(
                            "UPDATE entries SET last_used = ? WHERE key = ?",
                            [(self._tick(), key) for key in touched],
                        )
                    values = [
                        (
                            key,
                            tenant,
                            result.body,
                            result.prompt_tokens,
                            result.completion_tokens,
                            size,
                            self._tick(),
                        )
                        for key, tenant, result, size in rows
                    ]
                    inserted = db.executemany(
                        "INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)", values
                    ).rowcount
                    if inserted == len(values):  # the usual case: every key new
                        entries, size = self.entries + inserted, self.bytes + sum(row[3] for row in rows)
                    else:  # some stored already (equal lines ran side by side): count what is there
                        entries, size = db.execute(
                            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries"
                        ).fetchone()
                    evicted = self._evict_to(entries, size)
                self.entries, self.bytes = evicted[0], evicted[1]
                self.counts.stored += len(rows)
                self.counts.evicted += evicted[2]
                self._recovered()
            except sqlite3.Error as exc:
                self.entries, self.bytes, self._clock = entries_before, bytes_before, clock_before
                self._fault("store", exc)

    def _evict(self) -> None:
        entries, size, evicted = self._evict_to(self.entries, self.bytes)
        self.entries, self.bytes = entries, size
        self.counts.evicted += evicted

    def _evict_to(self, entries: int, size: int) -> tuple[int, int, int]:
        """Delete the least recently used entries until both bounds hold, inside the writer's
        transaction: the entries and bytes left, and how many were deleted."""
        settings = self.settings
        evicted = 0
        while entries > settings.max_entries or size > settings.max_bytes:
            batch = max(entries - settings.max_entries, 64)
            rows = self._writer.execute(
                "SELECT key, size FROM entries ORDER BY last_used LIMIT ?", (batch,)
            ).fetchall()
            if not rows:
                break
            doomed: list[str] = []
            for key, entry_bytes in rows:
                if entries <= settings.max_entries and size <= settings.max_bytes:
                    break
                doomed.append(key)
                entries -= 1
                size -= entry_bytes
            self._writer.executemany("DELETE FROM entries WHERE key = ?", [(key,) for key in doomed])
            evicted += len(doomed)
        return entries, size, evicted

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _fault(self, action: str, exc: sqlite3.Error) -> None:
        if not self._failing:
            logger.warning(
                "result cache: could not %s entries in %s: %s (going on without)", action, self.path, exc
            )
        self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            logger.info("result cache: %s works again", self.path)
        self._failing = False


class _Transaction:
    """``BEGIN IMMEDIATE`` … ``COMMIT``, or ``ROLLBACK`` when the body raises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self._db.execute("COMMIT")
        else:
            self._db.execute("ROLLBACK")
