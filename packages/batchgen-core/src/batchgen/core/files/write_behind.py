"""A file whose bytes start on their way to disk as it is written (``WriteBehindFile``).

Written bytes sit in the page cache as dirty pages until the kernel writes them back (once they
pass a tenth of memory, or grow 30 s old), and a dirty page cannot be dropped from the cache. An
upload of many gigabytes would then grow the cache by its whole size, and growing the cache is not
free: on our 2-core machine, writing 4 GB into a file costs about 16 CPU-seconds (225-238 MB/s)
when the cache grows by 4 GB, and 1.8 (2.3 GB/s) when the pages are dropped behind the writer.
Every ``WRITE_BEHIND_BYTES`` this file asks the kernel to start writing back what was just written
(``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE``: it does not wait for the disk, and the pages
stay cached), so that by the time the upload's validation has read them they are clean, and it
lets them go (``streamed_validation.segment_chunks(..., forget=True)``): the cache holds about the
bytes between the writer and the validation, not the upload. Where the call does not exist (not
Linux) the file is a plain buffered file.
"""

from __future__ import annotations

import ctypes
import io
import os
from collections.abc import Callable
from typing import Any

#: How many bytes are written between two requests to start writeback.
WRITE_BEHIND_BYTES = 8 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        function: Any = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_start_writeback = _sync_file_range()


class WriteBehindFile(io.BufferedWriter):
    """A buffered file written from ``position`` on (its raw file seeked there), whose writeback
    is started every ``WRITE_BEHIND_BYTES``."""

    def __init__(self, raw: io.FileIO, position: int = 0) -> None:
        super().__init__(raw)
        self._position = position
        self._started_to = position  # writeback requested up to here
        self.writebacks = 0  # how many times writeback was started (read by tests)

    def write(self, data: Any) -> int:
        written = super().write(data)
        self._position += written
        if self._position - self._started_to >= WRITE_BEHIND_BYTES:
            self._write_behind()
        return written

    def _write_behind(self) -> None:
        self.flush()
        if _start_writeback is not None:
            _start_writeback(
                self.fileno(), self._started_to, self._position - self._started_to, _SYNC_FILE_RANGE_WRITE
            )
            self.writebacks += 1
        self._started_to = self._position


def open_write_behind(path: os.PathLike[str] | str, *, position: int | None = None) -> WriteBehindFile:
    """``path`` made anew (``position`` None), or opened (made if missing), cut at ``position``
    and written from there on."""
    if position is None:
        return WriteBehindFile(io.FileIO(path, "w"))
    raw = io.FileIO(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
        raw.truncate(position)
        raw.seek(position)
    except BaseException:
        raw.close()
        raise
    return WriteBehindFile(raw, position)
