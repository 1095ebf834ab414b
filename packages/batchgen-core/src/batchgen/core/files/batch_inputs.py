"""A batch's input lines by number, for a replica that runs lines of batches it did not start.

A replica running shared work (``work.shard_runner``) is handed lines as (batch id, line number);
``BatchInputs.open(batch_id)`` finds the batch and its input file in the metadata store, indexes
the file (``batch_file.index_batch_file``: line ``n`` is the file's ``n``-th request line, blank
lines skipped, as the ledger counts them) in a worker thread and keeps it open, so that reading a
line is one ``pread``. The input file's recorded ``path`` is made a local one by ``readable``: the
same path when the contents live in a folder every replica mounts at the same place, a copy
fetched from the object store when they live there.

Many lines of a shard ask for the same batch at once; they share one opening (one metadata call,
one index), and the ``max_open`` inputs used last stay open (a batch's record, as kept here, is
what does not change while it runs: its endpoint, parameters and owner; a cancel is the runner's
to see). A batch or file that is gone raises ``InputGone``.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable

import anyio
import attrs

from batchgen.core.files.batch_file import LineIndex, index_batch_file
from batchgen.core.files.line_blocks import InputChanged
from batchgen.core.models import Batch
from batchgen.core.storage import MetadataStore
from batchgen.core.storage.metadata_calls import MetadataCalls

__all__ = ["DEFAULT_MAX_OPEN", "BatchInput", "BatchInputs", "InputGone"]

#: Inputs kept open at once, by default: a replica runs a few batches' shards at a time.
DEFAULT_MAX_OPEN = 16
#: Request lines longer than this are read in a worker thread, off the event loop.
LARGE_LINE_BYTES = 1 << 20


class InputGone(LookupError):
    """The batch, or its input file, is not in the metadata store (deleted, or never there)."""


@attrs.define(eq=False)
class BatchInput:
    """One batch's record and its open, indexed input file."""

    batch: Batch
    path: str
    index: LineIndex
    fd: int
    closed: bool = False

    @property
    def line_count(self) -> int:
        return len(self.index)

    async def line(self, number: int) -> bytes:
        """The bytes of request line ``number`` (0-based); ``InputChanged`` when the file is
        shorter than its index says, IndexError past the last line."""
        if not 0 <= number < len(self.index):
            raise IndexError(f"batch {self.batch.id} has {len(self.index)} request lines, not line {number}")
        offset, length = self.index.offsets[number], self.index.lengths[number]
        if length > LARGE_LINE_BYTES:  # through a descriptor of its own: ``fd`` may close meanwhile
            raw = await anyio.to_thread.run_sync(_read_at, self.path, offset, length)
        else:
            raw = os.pread(self.fd, length, offset)
        if len(raw) < length:
            raise InputChanged(
                f"the input file of batch {self.batch.id} ends before request line {number + 1}"
            )
        return raw

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


def _read_at(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as stream:
        stream.seek(offset)
        return stream.read(length)


class BatchInputs:
    """The inputs of the batches a replica runs lines of, opened on demand (see the module)."""

    def __init__(
        self,
        store: MetadataStore,
        calls: MetadataCalls | None = None,
        *,
        max_open: int = DEFAULT_MAX_OPEN,
        readable: Callable[[str], str | os.PathLike[str]] = str,
    ) -> None:
        """``readable(path)`` turns a file's recorded ``path`` into a local one holding its bytes
        (``BlobStore.readable``: a copy fetched from an object store); it runs in a worker thread."""
        if max_open < 1:
            raise ValueError(f"max_open must be at least 1, not {max_open!r}")
        self._store = store
        self._calls = calls or MetadataCalls(store)
        self._max_open = max_open
        self._readable = readable
        self._open: OrderedDict[str, BatchInput] = OrderedDict()
        self._opening: dict[str, asyncio.Future[BatchInput]] = {}

    async def open(self, batch_id: str) -> BatchInput:
        """The batch's input, opened once for every caller that asks meanwhile."""
        found = self._open.get(batch_id)
        if found is not None:
            self._open.move_to_end(batch_id)
            return found
        opening = self._opening.get(batch_id)
        if opening is None:
            opening = self._opening[batch_id] = asyncio.ensure_future(self._open_input(batch_id))
            opening.add_done_callback(lambda _done: self._opening.pop(batch_id, None))
        return await asyncio.shield(opening)  # one caller cancelled does not cancel the others'

    async def _open_input(self, batch_id: str) -> BatchInput:
        batch = await self._calls(self._store.get_batch, batch_id)
        if batch is None:
            raise InputGone(f"batch {batch_id} is not in the metadata store")
        file = await self._calls(self._store.get_file, batch.input_file_id)
        if file is None:
            raise InputGone(f"the input file {batch.input_file_id} of batch {batch_id} is gone")
        path, index = await anyio.to_thread.run_sync(self._index, file.path)
        fd = os.open(path, os.O_RDONLY)
        opened = BatchInput(batch, path, index, fd)
        self._open[batch_id] = opened
        while len(self._open) > self._max_open:
            _, oldest = self._open.popitem(last=False)
            oldest.close()  # a line read from it meanwhile has its bytes already: reads never yield
        return opened

    def _index(self, recorded_path: str) -> tuple[str, LineIndex]:
        path = os.fspath(self._readable(recorded_path))
        return path, index_batch_file(path, False)

    def forget(self, batch_id: str) -> None:
        """Close the batch's input (it ended): the next ``open`` reads its record again."""
        found = self._open.pop(batch_id, None)
        if found is not None:
            found.close()

    def close(self) -> None:
        for found in self._open.values():
            found.close()
        self._open.clear()
