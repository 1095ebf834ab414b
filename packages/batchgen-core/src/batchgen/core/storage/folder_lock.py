"""One owner per storage folder: an exclusive lock on ``{storage}/owner.lock`` held while a service runs.

Two services on one folder would both resume its unfinished batches and run the same requests
twice, so ``BatchService`` takes this lock before it touches the folder and keeps it until it
stops. The lock is the kernel's ``flock`` on an open file descriptor: it belongs to that open file,
so it ends when the descriptor is closed or the process dies in any way (``kill -9`` included) and
never outlives its owner. Each acquisition opens the file anew, so a second service in the same
process is refused too. The descriptor is not inherited by child processes started with ``exec``.

After locking, the owner writes who it is (pid, host, start time, command line) into the file, so
that a refused start can name the holder. Tools that only read or edit the metadata database (the
``batchgen-server keys`` commands) do not take the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from batchgen.core.errors import BatchGenError

#: The lock file inside the storage folder.
LOCK_FILE_NAME = "owner.lock"


@attrs.frozen
class FolderHolder:
    """Who holds a storage folder, as its lock file says (fields are None when it did not say)."""

    pid: int | None = None
    host: str | None = None
    started_at: str | None = None
    command: str | None = None

    def describe(self) -> str:
        """``process 1234 on host web-1, started 2026-12-01T16:40:21Z (batchgen-server --port 10900)``."""
        if self.pid is None:
            return "a process that has not yet written its name (it may be starting)"
        here = self.host == socket.gethostname()
        text = f"process {self.pid}" + (" (this process)" if here and self.pid == os.getpid() else "")
        if self.host:
            text += f" on host {self.host}"
        if self.started_at:
            text += f", started {self.started_at}"
        if self.command:
            text += f" ({self.command})"
        return text

    @classmethod
    def parse(cls, text: str) -> FolderHolder:
        try:
            record = json.loads(text)
        except ValueError:
            return cls()
        if not isinstance(record, dict):
            return cls()

        def field(name: str, kind: type) -> Any:
            value = record.get(name)
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        return cls(field("pid", int), field("host", str), field("started_at", str), field("command", str))


class StorageFolderInUse(BatchGenError):
    """Another service (in this process or another) owns the storage folder."""

    code = "storage_in_use"

    def __init__(self, folder: Path, holder: FolderHolder) -> None:
        super().__init__(
            f"The storage folder {folder} is in use by {holder.describe()}. A storage folder has one "
            "owner: two services on it would both resume its unfinished batches and run the same "
            "requests twice. Stop that one first, or use a storage folder of your own."
        )
        self.folder = folder
        self.holder = holder


def _this_process() -> FolderHolder:
    return FolderHolder(
        pid=os.getpid(),
        host=socket.gethostname(),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=shlex.join(sys.argv) if sys.argv and sys.argv[0] else None,
    )


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except PermissionError:  # another user's lock file: locking needs no write access
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def read_holder(folder: Path) -> FolderHolder:
    """What the lock file of ``folder`` says about its holder (empty when there is none)."""
    try:
        return FolderHolder.parse((Path(folder) / LOCK_FILE_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return FolderHolder()


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class FolderLock:
    """The exclusive lock of one storage folder; ``acquire`` raises ``StorageFolderInUse`` if taken."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (creating the folder if needed) and write this process's details into it."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this FolderLock")
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = _open(self.path)
        try:
            if not _try_lock(fd):
                raise StorageFolderInUse(self.folder, read_holder(self.folder))
            with contextlib.suppress(OSError):  # a read-only lock file: locked, but it cannot say who
                record = json.dumps(attrs.asdict(_this_process())).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, record + b"\n", 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (harmless when not held); the file stays, emptied, for the next owner."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def folder_holder(folder: Path | str) -> FolderHolder | None:
    """Who holds ``folder`` now, or None when nobody does (a check only: the lock is not kept).

    The answer may be out of date at once; only ``FolderLock.acquire`` decides. The check holds
    the lock for an instant when it is free, so a service starting at that very instant is
    refused as if a second one were starting (which, here, one is).
    """
    path = Path(folder) / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (nobody ever owned the folder), or one this user cannot read:
        return None  # the start itself will say what is wrong
    try:
        if _try_lock(fd):
            return None
    finally:
        os.close(fd)
    return read_holder(Path(folder))
