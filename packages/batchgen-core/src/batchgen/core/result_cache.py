"""The result cache: successful response bodies of deterministic requests, kept to be replayed.

It is opt-in per tenant (``ResultCacheSettings.tenants``; ``"*"`` names every tenant) and lives in
its own SQLite file in the storage folder (``result_cache.sqlite3``), so it survives a restart. A
server that names no tenant never opens or creates the file.

Each entry is one response body exactly as it was written in the first run's output line, with
its token counts, under the key ``result_cache_keys.cache_key`` made (the tenant is part of it).
The store is bounded by ``max_bytes`` (the bodies and keys) and ``max_entries``; whenever a store
would pass either, the least recently used entries (a hit counts as a use) are evicted in the
same transaction, so the file never holds more than its bound. Only the executor's successful
results are stored, never an error.

The cache only saves work: a call that fails (a full disk, a damaged file) is logged once and
treated as a miss or a store left out, and the batch goes on as without a cache.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path

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
    """The cache's SQLite file; every method is called on the event loop's thread."""

    def __init__(self, path: Path, settings: ResultCacheSettings) -> None:
        self.settings = settings
        self.path = path
        self.counts = CacheCounts()
        self._tenants = frozenset(settings.tenants)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=5.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
            "body BLOB NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
            "size INTEGER NOT NULL, last_used INTEGER NOT NULL)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS entries_last_used ON entries (last_used)")
        count, total, last = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(MAX(last_used), 0) FROM entries"
        ).fetchone()
        #: Entries and the bytes they count, kept equal to the file's.
        self.entries: int = count
        self.bytes: int = total
        self._clock: int = last
        self._failing = False
        with self._transaction():  # the bounds may be lower than when the file was filled
            self._evict()

    def close(self) -> None:
        self._db.close()

    def enabled_for(self, tenant: str) -> bool:
        """Whether ``tenant``'s requests use the cache."""
        return ALL_TENANTS in self._tenants or tenant in self._tenants

    def lookup(self, keys: Sequence[str]) -> dict[str, CachedResult]:
        """The entries of ``keys`` that are stored (each marked used now); a key not returned is a
        miss, and counted so; hits are counted by ``served`` once their lines are written."""
        found: dict[str, CachedResult] = {}
        unique = list(dict.fromkeys(keys))
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
            if found:
                with self._transaction():
                    self._db.executemany(
                        "UPDATE entries SET last_used = ? WHERE key = ?",
                        [(self._tick(), key) for key in found],
                    )
            self._recovered()
        except sqlite3.Error as exc:
            self._fault("look up", exc)
            found = {}
        self.counts.misses += sum(1 for key in keys if key not in found)
        return found

    def served(self, result: CachedResult) -> None:
        """A hit's line was written: count what it saved."""
        self.counts.hits += 1
        self.counts.saved_prompt_tokens += result.prompt_tokens
        self.counts.saved_completion_tokens += result.completion_tokens

    def store(self, entries: Iterable[tuple[str, str, CachedResult]]) -> None:
        """Store ``(key, tenant, result)`` entries in one transaction, evicting the least recently
        used as the bounds require. An entry larger than ``max_bytes`` by itself is left out."""
        rows = [
            (key, tenant, result, entry_size(key, result.body))
            for key, tenant, result in entries
            if entry_size(key, result.body) <= self.settings.max_bytes
        ]
        if not rows:
            return
        entries_before, bytes_before, clock_before = self.entries, self.bytes, self._clock
        values = [
            (key, tenant, result.body, result.prompt_tokens, result.completion_tokens, size, self._tick())
            for key, tenant, result, size in rows
        ]
        try:
            with self._transaction():
                inserted = self._db.executemany(
                    "INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)", values
                ).rowcount
                if inserted == len(values):  # the usual case: every key new
                    self.entries += inserted
                    self.bytes += sum(row[3] for row in rows)
                else:  # some computed twice (equal lines ran side by side): count what is there
                    self.entries, self.bytes = self._db.execute(
                        "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries"
                    ).fetchone()
                self._evict()
            self.counts.stored += len(rows)
            self._recovered()
        except sqlite3.Error as exc:
            self.entries, self.bytes, self._clock = entries_before, bytes_before, clock_before
            self._fault("store", exc)

    def _evict(self) -> None:
        """Delete the least recently used entries until both bounds hold (inside a transaction)."""
        settings = self.settings
        while self.entries > settings.max_entries or self.bytes > settings.max_bytes:
            over_entries = max(0, self.entries - settings.max_entries)
            batch = max(over_entries, 64)
            rows = self._db.execute(
                "SELECT key, size FROM entries ORDER BY last_used LIMIT ?", (batch,)
            ).fetchall()
            if not rows:
                break
            doomed: list[str] = []
            for key, size in rows:
                if self.entries <= settings.max_entries and self.bytes <= settings.max_bytes:
                    break
                doomed.append(key)
                self.entries -= 1
                self.bytes -= size
            self._db.executemany("DELETE FROM entries WHERE key = ?", [(key,) for key in doomed])
            self.counts.evicted += len(doomed)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

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
