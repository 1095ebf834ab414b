"""Storage faults: telling a fault of the storage (full disk, I/O error, read-only folder, a database
another connection holds locked) from a bug.

``storage_fault`` turns an ``OSError`` with such an errno, or an SQLite error that reports one
(``SQLITE_BUSY`` and ``SQLITE_LOCKED`` included: another process holding a write lock past the
store's short busy timeout), or a PostgreSQL error of the same kinds (a lock not granted within
the store's lock timeout, a statement timed out, the server unreachable, restarting or out of
disk; told by SQLSTATE, and only when psycopg is loaded at all), or an object store's error
other than an answer about one object (the store down or refusing; only when obstore is loaded), into a ``StorageUnavailable``
with the reason and a ``Retry-After``; anything else is not a storage fault and stays as it is. ``storage_faults_as_errors`` does that for a block of code: the service's calls raise
``StorageUnavailable`` instead of a raw ``OSError`` or ``sqlite3.OperationalError``.
"""

from __future__ import annotations

import errno
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from batchgen.core.errors import StorageUnavailable

#: errnos that mean the disk (or the user's quota) is full.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: errnos that mean the storage cannot be used now: I/O errors, a read-only or forbidden folder.
FAULT_ERRNOS = FULL_ERRNOS | frozenset({errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM})

#: Seconds a client is told to wait (``Retry-After``) when the database is locked by another connection.
LOCKED_RETRY_AFTER_S = 1

# SQLite's primary result codes (the low byte of an extended code).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_FULL = 13
_SQLITE_IOERR = 10
_SQLITE_READONLY = 8
_SQLITE_CANTOPEN = 14
_SQLITE_LOCK_CODES = frozenset({_SQLITE_BUSY, _SQLITE_LOCKED})
_SQLITE_REASONS = {
    _SQLITE_BUSY: "the database is locked by another connection",
    _SQLITE_LOCKED: "the database is locked by another connection",
    _SQLITE_FULL: "the database or disk is full",
    _SQLITE_IOERR: "a disk I/O error",
    _SQLITE_READONLY: "the database is read-only",
    _SQLITE_CANTOPEN: "the database file cannot be opened",
}
_SQLITE_MESSAGES = {
    "database or disk is full": _SQLITE_FULL,
    "disk i/o error": _SQLITE_IOERR,
    "attempt to write a readonly database": _SQLITE_READONLY,
    "unable to open database file": _SQLITE_CANTOPEN,
    "database is locked": _SQLITE_BUSY,
    "database table is locked": _SQLITE_LOCKED,
    "database schema is locked": _SQLITE_LOCKED,
}


# PostgreSQL's SQLSTATEs that pass by themselves (another transaction holds a lock, or a statement
# ran past its timeout), and the classes and codes that mean the server cannot serve now.
_PG_BUSY_STATES = frozenset({"55P03", "40001", "40P01", "57014"})
_PG_DOWN_CLASSES = frozenset({"08", "53", "58"})
_PG_DOWN_STATES = frozenset({"57P01", "57P02", "57P03"})
_PG_DISK_FULL = "53100"


def _postgres_fault(exc: BaseException) -> tuple[str, bool, bool] | None:
    """(reason, busy, disk_full) when ``exc`` is a psycopg error that is a storage fault."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:  # never loaded: nothing raised can be its error
        return None
    pool = sys.modules.get("psycopg_pool")
    if pool is not None and isinstance(exc, pool.PoolTimeout):
        return "no connection to the database could be had in time", False, False
    if not isinstance(exc, psycopg.Error):
        return None
    state = exc.sqlstate or ""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if state in _PG_BUSY_STATES:
        return f"the database is busy ({first_line})", True, False
    if state[:2] in _PG_DOWN_CLASSES or state in _PG_DOWN_STATES:
        return f"the database cannot serve now ({first_line})", False, state == _PG_DISK_FULL
    if not state and isinstance(exc, psycopg.OperationalError):  # no answer: unreachable, or gone
        return f"the database cannot be reached ({first_line})", False, False
    return None


def _object_store_fault(exc: BaseException) -> str | None:
    """The reason when ``exc`` is an obstore error saying the object store cannot serve now (it
    is down, refuses the credentials, or keeps failing past the client's retries)."""
    errors = sys.modules.get("obstore.exceptions")
    if errors is None or not isinstance(exc, errors.BaseError):
        return None
    answers = (
        errors.NotFoundError,
        errors.AlreadyExistsError,
        errors.PreconditionError,
        errors.NotModifiedError,
    )
    if isinstance(exc, answers):  # the store answered about one object: not a fault of the store
        return None
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"the object store cannot serve now ({first_line[:300]})"


def _sqlite_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in _SQLITE_REASONS:
        return code & 0xFF
    text = str(exc).lower()
    return next((value for message, value in _SQLITE_MESSAGES.items() if message in text), None)


def storage_fault(exc: BaseException, action: str = "use the storage") -> StorageUnavailable | None:
    """``exc`` as a ``StorageUnavailable`` naming ``action`` and the reason, or None if it is not
    a storage fault."""
    if isinstance(exc, StorageUnavailable):
        return exc
    if isinstance(exc, OSError) and exc.errno in FAULT_ERRNOS:
        reason = exc.strerror or str(exc)
        disk_full = exc.errno in FULL_ERRNOS
    elif isinstance(exc, sqlite3.Error) and (code := _sqlite_code(exc)) is not None:
        reason = f"{_SQLITE_REASONS[code]} ({exc})"
        disk_full = code == _SQLITE_FULL
        if code in _SQLITE_LOCK_CODES:
            return StorageUnavailable(
                f"The server could not {action}: {reason}. Retry in a moment.",
                disk_full=False,
                retry_after_s=LOCKED_RETRY_AFTER_S,
            )
    elif (object_store := _object_store_fault(exc)) is not None:
        reason, disk_full = object_store, False
    elif (postgres := _postgres_fault(exc)) is not None:
        reason, busy, disk_full = postgres
        if busy:
            return StorageUnavailable(
                f"The server could not {action}: {reason}. Retry in a moment.",
                disk_full=False,
                retry_after_s=LOCKED_RETRY_AFTER_S,
            )
    else:
        return None
    retry = "Free some disk space and retry." if disk_full else "Retry once the storage works again."
    return StorageUnavailable(f"The server could not {action}: {reason}. {retry}", disk_full=disk_full)


def is_storage_fault(exc: BaseException) -> bool:
    return storage_fault(exc) is not None


def is_database_locked(exc: BaseException) -> bool:
    """Whether ``exc`` (or the SQLite error it was raised from) says another connection holds the
    database locked: a fault that passes by itself, so work that cannot be refused (a batch being
    started) waits and tries again instead of failing."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sqlite3.Error) and _sqlite_code(seen) in _SQLITE_LOCK_CODES:
            return True
        if (postgres := _postgres_fault(seen)) is not None and postgres[1]:
            return True
        seen = seen.__cause__
    return False


@contextmanager
def storage_faults_as_errors(action: str) -> Iterator[None]:
    """Raise a storage fault inside the block as ``StorageUnavailable`` (naming ``action``)."""
    try:
        yield
    except Exception as exc:  # only storage faults are turned; anything else goes on as it was
        fault = storage_fault(exc, action)
        if fault is None or fault is exc:
            raise
        raise fault from exc
