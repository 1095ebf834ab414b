"""The intake pool: the bounded queue of requests waiting for a slot, fair across batches.

Entries are tiny: per batch it keeps the file's line index (offset and length of each line) and
the positions still to run, never a request body. ``pop`` takes batches in turn (round-robin), so a
small batch queued behind a huge one starts at once instead of waiting for the huge one to drain.

A batch that was accepted but is not indexed yet holds a **reservation**: room counted against
``free`` from the moment the batch is accepted, so that concurrent creates cannot all be promised
the same places. ``add`` converts a batch's reservation into queued entries; ``release`` (or
``drop``, when the batch fails or is cancelled first) gives the room back.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable

import attrs

from batchgen.core.batch_file import LineIndex
from batchgen.core.errors import IntakeFull
from batchgen.core.scheduling.drain_meter import DrainMeter


@attrs.frozen
class IntakeEntry:
    """One queued request: which batch, which line, and where that line lies in the input file."""

    batch_id: str
    line: int  # 0-based position among the file's request lines
    offset: int
    length: int


class _BatchQueue:
    __slots__ = ("cursor", "index", "pending")

    def __init__(self, index: LineIndex, pending: array) -> None:
        self.index = index
        self.pending = pending
        self.cursor = 0

    def __len__(self) -> int:
        return len(self.pending) - self.cursor


class IntakePool:
    """Queued requests of every active batch, at most ``capacity`` in all."""

    def __init__(self, capacity: int, drain: DrainMeter | None = None) -> None:
        """``drain`` measures how fast requests finish, to estimate ``retry_after_s``."""
        if capacity < 1:
            raise ValueError("intake capacity must be at least 1")
        self.capacity = capacity
        self.drain = drain or DrainMeter()
        self._queues: dict[str, _BatchQueue] = {}
        self._turns: deque[str] = deque()
        self._size = 0
        self._reservations: dict[str, int] = {}
        self._reserved = 0

    @property
    def size(self) -> int:
        """Requests queued now."""
        return self._size

    @property
    def reserved(self) -> int:
        """Places held for accepted batches that are not queued yet."""
        return self._reserved

    @property
    def free(self) -> int:
        return self.capacity - self._size - self._reserved

    def reserved_for(self, batch_id: str) -> int:
        return self._reservations.get(batch_id, 0)

    def retry_after_s(self, requests: int) -> int:
        """Seconds until ``requests`` places are likely free, at the current drain rate (1..300)."""
        return self.drain.wait_for(requests - self.free)

    def reserve(self, batch_id: str, requests: int) -> None:
        """Hold ``requests`` places for a batch until ``add`` queues it or ``release`` gives them back.

        Raises IntakeFull, holding nothing, when they do not fit now.
        """
        if requests < 0:
            raise ValueError("a reservation cannot be negative")
        if batch_id in self._reservations or batch_id in self._queues:
            raise ValueError(f"batch {batch_id} already holds room in the intake pool")
        if requests > self.free:
            raise IntakeFull(
                f"The intake pool has room for {self.free} more requests; this batch has {requests}.",
                retry_after_s=self.retry_after_s(requests),
            )
        self._reservations[batch_id] = requests
        self._reserved += requests

    def release(self, batch_id: str) -> int:
        """Give back a batch's reservation (it failed or was cancelled before it was queued)."""
        held = self._reservations.pop(batch_id, 0)
        self._reserved -= held
        return held

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._queues

    def queued(self, batch_id: str) -> int:
        queue = self._queues.get(batch_id)
        return 0 if queue is None else len(queue)

    def add(self, batch_id: str, index: LineIndex, lines: Iterable[int] | None = None) -> int:
        """Queue ``lines`` (all lines of ``index`` when None) of a batch; return how many.

        The batch's reservation, if it holds one, is converted: the queued requests take its
        places, and any it held beyond them are given back. Raises IntakeFull, queueing nothing
        and keeping the reservation, when they do not all fit.
        """
        if batch_id in self._queues:
            raise ValueError(f"batch {batch_id} is already queued")
        pending = array("l", range(len(index)) if lines is None else lines)
        if lines is not None and pending:
            if min(pending) < 0 or max(pending) >= len(index):
                raise ValueError(f"line positions must be in 0..{len(index) - 1}")
            if len(set(pending)) != len(pending):
                raise ValueError("line positions must not repeat")
        room = self.free + self.reserved_for(batch_id)
        if len(pending) > room:
            raise IntakeFull(
                f"The intake pool has room for {room} more requests; this batch has {len(pending)}.",
                retry_after_s=self.drain.wait_for(len(pending) - room),
            )
        self.release(batch_id)
        if not pending:
            return 0
        self._queues[batch_id] = _BatchQueue(index, pending)
        self._turns.append(batch_id)
        self._size += len(pending)
        return len(pending)

    def pop(self) -> IntakeEntry | None:
        """Take the next request, giving each batch with queued work one turn in order."""
        if not self._turns:
            return None
        batch_id = self._turns.popleft()
        queue = self._queues[batch_id]
        line = queue.pending[queue.cursor]
        queue.cursor += 1
        self._size -= 1
        if len(queue):
            self._turns.append(batch_id)
        else:
            del self._queues[batch_id]
        return IntakeEntry(batch_id, line, queue.index.offsets[line], queue.index.lengths[line])

    def drop(self, batch_id: str) -> int:
        """Remove every queued request of a batch and release its reservation; return how many
        queued requests were dropped."""
        self.release(batch_id)
        queue = self._queues.pop(batch_id, None)
        if queue is None:
            return 0
        self._turns.remove(batch_id)
        dropped = len(queue)
        self._size -= dropped
        return dropped
