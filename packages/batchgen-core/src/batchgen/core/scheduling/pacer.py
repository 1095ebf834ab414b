"""The pacer: keeps request tasks from holding the event loop, so the API stays responsive.

A request task that needs no I/O (the zero-latency simulated backend, a request that fails at
once) never gives the loop a chance to serve anything else; thousands of them ready at once make
one turn of the loop last a second or more, and ``/health`` waits that long. Before each request,
or group of requests, a task calls ``pace(requests)``: while the current turn's time budget lasts
it only yields; once the budget is spent it parks in a queue, and the pacer's own task wakes parked
tasks in the order they parked, about ``wake_per_turn`` requests' worth per turn (at least one
task). So one turn runs at most about ``budget_s`` of request work plus ``wake_per_turn`` requests
(or one group), and the server's own I/O gets its turn in between.
"""

from __future__ import annotations

import time
from collections import deque

import anyio
import anyio.lowlevel


class Pacer:
    """Bounds the request work done in one turn of the event loop."""

    def __init__(self, budget_s: float = 0.005, wake_per_turn: int = 256) -> None:
        self.budget_s = budget_s
        self.wake_per_turn = wake_per_turn
        self._turn_ends = 0.0
        self._parked: deque[tuple[anyio.Event, int]] = deque()
        self._work = anyio.Event()

    @property
    def parked(self) -> int:
        """Tasks waiting for a later turn."""
        return len(self._parked)

    def open(self) -> bool:
        """Whether this turn's budget lasts and nobody waits: a task that has just started (and so
        has yielded to the loop already) may run now without pacing."""
        return not self._parked and time.perf_counter() < self._turn_ends

    async def pace(self, requests: int = 1) -> None:
        """Yield to the loop before running ``requests``; wait for a later turn if this turn's
        budget is spent or others wait."""
        if not self._parked and time.perf_counter() < self._turn_ends:
            await anyio.lowlevel.checkpoint()
            return
        turn = anyio.Event()
        self._parked.append((turn, requests))
        self._work.set()
        await turn.wait()

    async def run(self) -> None:
        """Start a new turn each time the loop comes round, waking parked tasks; until cancelled."""
        while True:
            await self._work.wait()
            self._turn_ends = time.perf_counter() + self.budget_s
            woken = 0
            while self._parked and woken < self.wake_per_turn:
                turn, requests = self._parked.popleft()
                turn.set()
                woken += requests
            if not self._parked:
                self._work = anyio.Event()
            await anyio.lowlevel.checkpoint()  # the next turn, after the loop has polled for I/O
