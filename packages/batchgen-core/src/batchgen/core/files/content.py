"""A stored file's bytes as a reader gets them: from a file on disk, or from committed segments.

``GET /v1/files/{id}/content`` asks the service for a ``FileContent``: its ``size`` now (a running
batch's output keeps growing), and ``open(start, stop)``, which opens the bytes ``[start, stop)``
at once (``NotFound`` for a file deleted meanwhile, so nothing fails once a response has started)
and hands them over in chunks as they are read.

- ``DiskContent``: an uploaded file, or a single process's result file, read from its path.
- ``SegmentContent``: a shared batch's result file, the committed segments of one kind read
  through the segment store (``work.segment_store``), in commit order, or, once a batch that asked
  for input order has ended, in input-line order (``work.ordered_segments``; the same size); the
  manifest is taken when the content is asked for, so the bytes a reader is told about never
  move. The first piece is read by ``open``: a store that is down is a ``StorageUnavailable``
  (503) before the response starts, not a response cut off at its first byte.

Reads run in worker threads: a large file, or a segment on a slow shared mount, never holds the
event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import anyio
import attrs

from batchgen.core.errors import NotFound
from batchgen.core.storage.faults import storage_faults_as_errors
from batchgen.core.work.ordered_segments import InputOrder
from batchgen.core.work.segment_store import SegmentStore
from batchgen.core.work.shards import Segment

__all__ = ["CHUNK_BYTES", "DiskContent", "FileContent", "SegmentContent"]

#: The most bytes one chunk of a file's content holds.
CHUNK_BYTES = 256 * 1024


class FileContent(Protocol):
    """A file's bytes: how many there are now, and a way to read a range of them."""

    @property
    def size(self) -> int: ...

    async def open(self, start: int, stop: int) -> AsyncIterator[bytes]:
        """The bytes ``[start, stop)``, opened now and read as they are iterated."""
        ...


@attrs.frozen
class DiskContent:
    """A file on disk (``file_id`` names it in the NotFound of a file deleted meanwhile)."""

    file_id: str
    path: Path
    size: int

    async def open(self, start: int, stop: int) -> AsyncIterator[bytes]:
        try:
            stream = await anyio.open_file(self.path, "rb")
        except FileNotFoundError as exc:  # deleted since its size was read
            raise NotFound(f"No file with id '{self.file_id}'.") from exc
        await stream.seek(start)
        return _chunks_of(stream, stop - start)


async def _chunks_of(stream: anyio.AsyncFile[bytes], length: int) -> AsyncIterator[bytes]:
    remaining = length
    try:
        while remaining > 0:
            chunk = await stream.read(min(CHUNK_BYTES, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk
    finally:
        await stream.aclose()


@attrs.frozen
class SegmentContent:
    """A shared batch's result file: its committed ``segments`` of one kind, in commit order, or
    in input order when ``input_order`` lays them out so."""

    store: SegmentStore
    segments: Sequence[Segment]
    size: int
    input_order: InputOrder | None = None

    @classmethod
    def of(
        cls, store: SegmentStore, segments: Sequence[Segment], *, in_input_order: bool = False
    ) -> SegmentContent:
        segments = tuple(segments)
        return cls(store, segments, store.size(segments), InputOrder.of(segments) if in_input_order else None)

    async def open(self, start: int, stop: int) -> AsyncIterator[bytes]:
        """The bytes ``start`` .. ``stop``, the first piece read already: a store that cannot be
        read now, or that lacks a segment of the range (or holds less of it than was committed),
        raises ``StorageUnavailable`` here, before a response has begun."""
        pieces = self._pieces(start, stop)  # a generator: nothing is read yet
        try:
            with storage_faults_as_errors("read the file"):
                # every segment the range needs is there, whole: the response's length holds
                if self.input_order is None:
                    await anyio.to_thread.run_sync(self.store.check_readable, self.segments, start, stop)
                else:
                    await anyio.to_thread.run_sync(self.store.check_readable, self.segments)
                first = await anyio.to_thread.run_sync(next, pieces, _DONE)
        except BaseException:
            _close(pieces)
            raise
        return _chunks_from(first, pieces)

    def _pieces(self, start: int, stop: int) -> Iterator[bytes]:
        if self.input_order is None:
            return self.store.read(self.segments, start, stop)
        return self.input_order.read(self.store, start, stop)


#: What ``next`` gives for a generator that has no more pieces.
_DONE = object()


async def _chunks_from(first: object, pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    piece = first
    try:
        while piece is not _DONE:
            assert isinstance(piece, bytes)
            yield piece
            piece = await anyio.to_thread.run_sync(next, pieces, _DONE)
    finally:
        _close(pieces)


def _close(pieces: Iterator[bytes]) -> None:
    close = getattr(pieces, "close", None)
    if close is not None:
        close()
