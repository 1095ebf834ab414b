"""The drain meter: how fast requests finish now, and how long a given number of them takes to drain.

The scheduler tells the meter when it admits requests into slots (``admitted``) and when they
finish (``record``); the intake pool asks how many seconds it will take for ``n`` more places to
come free, to tell a refused client when to come back (``Retry-After``). Finishes are counted in
one-second buckets over a recent window, so the estimate follows the current load rather than the
service's whole life.

The rate is finishes divided by the time they were measured over: the window, or less when the
work began more recently (a **busy period** starts at the first admission after the slots stood
empty for ``IDLE_RESET_S`` or more; it starts afresh, forgetting older finishes). Dividing by the
whole window instead would spread a few seconds of work over thirty and tell clients to wait many
times longer than the pool takes to drain. Until something has finished in the window there is
no rate: the estimate is then how long the slots have gone without a finish (a client refused
just after the work began looks again soon; one refused while nothing finishes backs off), at
most one window.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

#: Bounds of the estimate, in whole seconds.
MIN_WAIT_S = 1
MAX_WAIT_S = 300
#: How long the slots must stand empty before the next admission starts a new busy period; a
#: shorter gap (a finished request's slot refilled a moment later) continues the current one.
IDLE_RESET_S = 1.0


class DrainMeter:
    """Requests finished per second over the last ``window_s`` seconds of the current busy period."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s < 1:
            raise ValueError("the drain window must be at least one second")
        self.window_s = window_s
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [whole second, finishes in it], oldest first
        self._count = 0
        # a meter told only of finishes measures from its creation
        self._busy_since = clock()
        self._idle_since: float | None = None  # None: nothing admitted yet
        self._in_flight = 0
        self._last_finish: float | None = None

    def admitted(self, requests: int = 1) -> None:
        """Count ``requests`` as taken into slots now; the first after an idle spell starts a busy period."""
        moment = self._clock()
        if self._in_flight == 0 and (self._idle_since is None or moment - self._idle_since >= IDLE_RESET_S):
            self._buckets.clear()
            self._count = 0
            self._busy_since = moment
            self._last_finish = None
        self._in_flight += requests

    def record(self, finished: int = 1) -> None:
        """Count ``finished`` requests as finished now."""
        moment = self._clock()
        second = int(moment)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += finished
        else:
            self._buckets.append([second, finished])
        self._count += finished
        self._last_finish = moment
        self._in_flight = max(0, self._in_flight - finished)
        if self._in_flight == 0:
            self._idle_since = moment
        self._trim(second)

    def rate(self) -> float:
        """Finishes per second over the window, or over the busy period when that is shorter."""
        moment = self._clock()
        self._trim(int(moment))
        if not self._count:
            return 0.0
        span = moment - max(self._window_start(moment), self._busy_since)
        return self._count / span if span > 0 else math.inf

    def wait_for(self, places: int) -> int:
        """Whole seconds, within 1..300, until ``places`` more requests have finished at the current
        rate; with nothing finished in the window, as long as the slots have gone without a finish
        (at most the window)."""
        if places <= 0:
            return MIN_WAIT_S
        rate = self.rate()
        if rate > 0:
            return _bounded(places / rate, MAX_WAIT_S)
        quiet_since = (
            self._busy_since if self._last_finish is None else max(self._busy_since, self._last_finish)
        )
        return _bounded(self._clock() - quiet_since, math.ceil(self.window_s))

    def _window_start(self, moment: float) -> int:
        """The start of the oldest whole second the window keeps."""
        return int(moment) - math.ceil(self.window_s) + 1

    def _trim(self, second: int) -> None:
        oldest = second - math.ceil(self.window_s)
        while self._buckets and self._buckets[0][0] <= oldest:
            self._count -= self._buckets.popleft()[1]


def _bounded(seconds: float, most: int) -> int:
    """``seconds`` rounded up to a whole second, within ``MIN_WAIT_S``..``most``."""
    return max(MIN_WAIT_S, min(most, math.ceil(seconds)))
