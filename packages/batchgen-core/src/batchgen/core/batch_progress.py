"""How fast one batch is finishing its requests now, and when it will be done at that pace.

A ``ProgressWindow`` keeps a few samples of a batch's finished-request count (at most one per
second, over the last ``window_s`` seconds, plus the one just before them as the anchor). The rate
is the requests finished since the anchor over the time since it, so a batch that stalls sees its
rate fall, and time spent queued long ago stops counting once the window has passed it.

``estimate`` is pure: the rate (requests per second, None until a second has passed since the
first sample) and the seconds left at that rate (None when the rate is unknown or zero, or
nothing is left). Neither is ever negative. The tracker adds them to a running batch's object as
``requests_per_second``, ``estimated_seconds_remaining`` and ``estimated_completion_at``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import attrs

#: Seconds of history the rate is measured over.
DEFAULT_WINDOW_S = 20.0
#: Less history than this gives no rate (one request done in a millisecond is no pace).
MIN_SPAN_S = 1.0


@attrs.frozen
class ProgressEstimate:
    """A batch's recent pace and what it predicts; None where it is unknown."""

    requests_per_second: float | None = None
    seconds_remaining: float | None = None
    #: The Unix time (whole seconds, rounded up) the batch is expected to be done.
    completion_at: int | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        """The batch object's fields (rounded for reading)."""
        rate, left = self.requests_per_second, self.seconds_remaining
        return {
            "requests_per_second": None if rate is None else round(rate, 3),
            "estimated_seconds_remaining": None if left is None else round(left, 1),
            "estimated_completion_at": self.completion_at,
        }


UNKNOWN = ProgressEstimate()


def estimate(
    samples: list[tuple[float, int]], now: float, remaining: int, window_s: float = DEFAULT_WINDOW_S
) -> ProgressEstimate:
    """The pace over the last ``window_s`` seconds of ``samples`` ((time, finished so far), oldest
    first) up to ``now``, and the seconds ``remaining`` requests take at it."""
    start = 0
    while start + 1 < len(samples) and samples[start + 1][0] <= now - window_s:
        start += 1  # the anchor: the last sample at or before the window's start
    if not samples:
        return UNKNOWN
    anchor_time, anchor_done = samples[start]
    span = now - anchor_time
    if span < MIN_SPAN_S:
        return UNKNOWN
    done = max(0, max(finished for _, finished in samples[start:]) - anchor_done)
    rate = done / span
    if rate <= 0 or remaining <= 0:
        return ProgressEstimate(requests_per_second=rate)
    return ProgressEstimate(requests_per_second=rate, seconds_remaining=remaining / rate)


class ProgressWindow:
    """Recent samples of one batch's finished count; ``record`` it as requests finish."""

    def __init__(
        self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s < MIN_SPAN_S:
            raise ValueError(f"the progress window must be at least {MIN_SPAN_S} s")
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque([(clock(), 0)])  # nothing done at the start

    def restart(self, finished: int) -> None:
        """Forget the history and start again from ``finished`` requests done now (after a
        restart has rebuilt the counts, which were not finished at this pace)."""
        self._samples.clear()
        self._samples.append((self._clock(), finished))

    def record(self, finished: int) -> None:
        """``finished`` requests are done now (one sample per second: a later one replaces it)."""
        moment = self._clock()
        if len(self._samples) > 1 and int(self._samples[-1][0]) == int(moment):
            self._samples[-1] = (moment, finished)
        else:
            self._samples.append((moment, finished))
        while len(self._samples) > 2 and self._samples[1][0] <= moment - self.window_s:
            self._samples.popleft()

    def estimate(self, finished: int, total: int, wall_now: float | None = None) -> ProgressEstimate:
        """The pace now, with ``finished`` of ``total`` requests done, and when it ends (Unix
        time, from ``wall_now``, else the clock on the wall)."""
        samples = list(self._samples)
        samples.append((self._clock(), finished))
        found = estimate(samples, samples[-1][0], total - finished, self.window_s)
        if found.seconds_remaining is None:
            return found
        wall_now = time.time() if wall_now is None else wall_now
        return attrs.evolve(found, completion_at=math.ceil(wall_now + found.seconds_remaining))
