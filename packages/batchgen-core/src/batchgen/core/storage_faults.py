"""Storage faults: telling a fault of the storage (full disk, I/O error, read-only folder, a database
another connection holds locked) from a bug.

``storage_fault`` turns an ``OSError`` with such an errno, or an SQLite error that reports one
(``SQLITE_BUSY`` and ``SQLITE_LOCKED`` included: another process holding a write lock past the
store's short busy timeout), into a ``StorageUnavailable`` with the reason and a ``Retry-After``;
anything else is not a storage fault and stays as it is. ``storage_faults_as_errors`` does that for a block of code: the service's calls raise
``StorageUnavailable`` instead of a raw ``OSError`` or ``sqlite3.OperationalError``.
"""

from __future__ import annotations

import errno
import sqlite3
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
        seen = seen.__cause__
    return False


@contextmanager
def storage_faults_as_errors(action: str) -> Iterator[None]:
    """Raise a storage fault inside the block as ``StorageUnavailable`` (naming ``action``)."""
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        fault = storage_fault(exc, action)
        if fault is None or fault is exc:
            raise
        raise fault from exc
