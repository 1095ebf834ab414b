"""The drain meter: how fast requests finish now, and how long a given number of them takes to drain.

The scheduler records each finished request; the intake pool asks how many seconds it will take
for ``n`` more places to come free, to tell a refused client when to come back (``Retry-After``).
Finishes are counted in one-second buckets over a recent window, so the estimate follows the
current load rather than the service's whole life.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

#: Bounds of the estimate, in whole seconds.
MIN_WAIT_S = 1
MAX_WAIT_S = 300


class DrainMeter:
    """Requests finished per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s < 1:
            raise ValueError("the drain window must be at least one second")
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._buckets: deque[list[int]] = deque()  # [whole second, finishes in it], oldest first
        self._count = 0

    def record(self, finished: int = 1) -> None:
        """Count ``finished`` requests as finished now."""
        second = int(self._clock())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += finished
        else:
            self._buckets.append([second, finished])
        self._count += finished
        self._trim(second)

    def rate(self) -> float:
        """Finishes per second over the window (or over the meter's life, when that is shorter)."""
        moment = self._clock()
        self._trim(int(moment))
        span = max(1.0, min(self.window_s, moment - self._started))
        return self._count / span

    def wait_for(self, places: int) -> int:
        """Whole seconds, within 1..300, until ``places`` more requests have finished at the current
        rate; with nothing finished in the window, the window's length (look again after as long)."""
        rate = self.rate()
        estimate = self.window_s if rate <= 0 else max(0, places) / rate
        return max(MIN_WAIT_S, min(MAX_WAIT_S, math.ceil(estimate)))

    def _trim(self, second: int) -> None:
        oldest = second - math.ceil(self.window_s)
        while self._buckets and self._buckets[0][0] <= oldest:
            self._count -= self._buckets.popleft()[1]
