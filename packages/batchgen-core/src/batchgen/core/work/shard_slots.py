"""ShardSlots: the lines one replica runs at once, shared fairly by the shards it holds.

A replica runs at most ``capacity`` lines at once over all its shards. Every line of a held
shard waits for a slot (``acquire(shard)``) and gives it back when it ends (``release(shard)``).
A slot that comes free goes to the waiting shard with the fewest lines running now (the one that
started waiting first, on a tie), not to the line that waited longest: a shard taken over from a
dead replica, or the first shard of a small batch, starts running within one line's time even
while thousands of lines of the shards held before it wait, instead of after all of them.

The invariants (held by ``tests/core/test_shard_slots.py``, a Hypothesis state machine): never
more than ``capacity`` lines run; no slot stays free while a line waits; a slot that comes free
goes to a waiting shard with the fewest running; a cancelled wait takes no slot and leaks none.
One event loop uses it; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Hashable

__all__ = ["ShardSlots"]


class ShardSlots:
    """``capacity`` slots, handed to waiting shards fewest-running first (see the module)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a replica runs at least one line at once, not {capacity!r}")
        self.capacity = capacity
        self._free = capacity
        self._running: dict[Hashable, int] = {}
        #: Each waiting shard's waiters, in order, and when it began waiting (for ties).
        self._waiting: dict[Hashable, deque[asyncio.Future[None]]] = {}
        self._since: dict[Hashable, int] = {}
        self._order = itertools.count()

    @property
    def free(self) -> int:
        return self._free

    def running(self, shard: Hashable) -> int:
        return self._running.get(shard, 0)

    def waiting(self, shard: Hashable) -> int:
        return sum(1 for waiter in self._waiting.get(shard, ()) if not waiter.done())

    async def acquire(self, shard: Hashable) -> None:
        """Wait for a slot for one line of ``shard``."""
        if self._free > 0 and not self._waiting:
            self._take(shard)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if shard not in self._waiting:
            self._waiting[shard] = deque()
            self._since[shard] = next(self._order)
        self._waiting[shard].append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot as it was cancelled
                self.release(shard)
            else:
                self._forget(shard, waiter)
            raise

    def release(self, shard: Hashable) -> None:
        """Give back the slot of one line of ``shard`` that ended."""
        running = self._running.get(shard, 0)
        if running < 1:
            raise RuntimeError(f"shard {shard!r} has no line running")
        if running == 1:
            del self._running[shard]
        else:
            self._running[shard] = running - 1
        self._free += 1
        self._hand_over()

    def _take(self, shard: Hashable) -> None:
        self._free -= 1
        self._running[shard] = self._running.get(shard, 0) + 1

    def _forget(self, shard: Hashable, waiter: asyncio.Future[None]) -> None:
        waiters = self._waiting.get(shard)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):  # handed over (and skipped) already
            waiters.remove(waiter)
        if not waiters:
            del self._waiting[shard]
            del self._since[shard]
        self._hand_over()  # a slot free and waiters left: they may go now

    def _hand_over(self) -> None:
        while self._free > 0 and self._waiting:
            shard = min(self._waiting, key=lambda key: (self._running.get(key, 0), self._since[key]))
            waiters = self._waiting[shard]
            waiter = waiters.popleft()
            if not waiters:
                del self._waiting[shard]
                del self._since[shard]
            if waiter.done():  # cancelled, its task not yet told
                continue
            self._take(shard)
            waiter.set_result(None)
