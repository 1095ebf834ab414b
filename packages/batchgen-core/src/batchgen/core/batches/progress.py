"""How fast one batch is finishing its requests now, and when it will be done at that pace.

A ``ProgressWindow`` follows a batch's finished-request count with an exponentially weighted
rate (``SmoothedRate``, time constant ``DEFAULT_WINDOW_S``): each stretch of the batch's run
counts with the pace it had, weighted by ``exp(-age / DEFAULT_WINDOW_S)``. Requests that end
in bursts (a transformers batch's rows finishing together, every half minute or so) move the
pace by their share of the last two minutes instead of swinging it from zero to a spike, so the
time left stays steady; a batch that stalls sees its pace fall (and its time left grow) as the
stall lengthens; time spent queued long ago weighs less and less.

``estimate`` gives the pace (requests per second, None until a second has passed since the
window began) and the seconds left at it (None when the pace is unknown or zero, or nothing is
left). Neither is ever negative. The tracker adds them to a running batch's object as
``requests_per_second``, ``estimated_seconds_remaining`` and ``estimated_completion_at``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import attrs

from batchgen.core.models import UNKNOWN, ProgressEstimate
from batchgen.core.smoothed_rate import SmoothedRate

#: The time constant (seconds) of the batch's pace: what happened that long ago weighs 1/e.
DEFAULT_WINDOW_S = 120.0
#: Less history than this gives no pace (one request done in a millisecond is no pace).
MIN_SPAN_S = 1.0


def estimate(rate: float | None, remaining: int) -> ProgressEstimate:
    """What a pace of ``rate`` requests per second (None: unknown) predicts for ``remaining``."""
    if rate is None:
        return UNKNOWN
    rate = max(0.0, rate)
    if rate <= 0 or remaining <= 0:
        return ProgressEstimate(requests_per_second=rate)
    return ProgressEstimate(requests_per_second=rate, seconds_remaining=remaining / rate)


class ProgressWindow:
    """One batch's smoothed pace; ``record`` its finished count as requests finish."""

    def __init__(
        self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s < MIN_SPAN_S:
            raise ValueError(f"the progress window must be at least {MIN_SPAN_S} s")
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._rate = SmoothedRate(window_s, self._started)  # nothing done at the start

    def restart(self, finished: int) -> None:
        """Forget the history and start again from ``finished`` requests done now (after a
        restart has rebuilt the counts, which were not finished at this pace)."""
        self._started = self._clock()
        self._rate = SmoothedRate(self.window_s, self._started, finished)

    def record(self, finished: int) -> None:
        """``finished`` requests are done now."""
        self._rate.update(self._clock(), finished)

    def estimate(self, finished: int, total: int, wall_now: float | None = None) -> ProgressEstimate:
        """The pace now, with ``finished`` of ``total`` requests done, and when it ends (Unix
        time, from ``wall_now``, else the clock on the wall)."""
        moment = self._clock()
        rate = self._rate.peek(moment, finished)
        known = moment - self._started >= MIN_SPAN_S
        found = estimate(rate if known else None, total - finished)
        if found.seconds_remaining is None:
            return found
        wall_now = time.time() if wall_now is None else wall_now
        return attrs.evolve(found, completion_at=math.ceil(wall_now + found.seconds_remaining))
