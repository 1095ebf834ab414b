"""An exponentially weighted rate of a running count: how fast it has been growing lately.

``SmoothedRate`` is fed a running total (requests finished, tokens generated) at any moments,
as often or as seldom as its readers come, and says how fast that total grows. Each interval
between two readings counts with the rate it had (its growth spread evenly over it), weighted
by ``exp(-age / time_constant_s)``; the weights are normalised by the time seen so far, so a
young meter reports the plain average since its start rather than a rate dragged towards zero.

What this buys over a fixed window: a burst of finishes (a transformers batch whose rows end
together) moves the rate by its share of the last ``time_constant_s`` seconds, never from zero
to a spike and back; a lull lowers it at most by ``exp(-lull / time_constant_s)``. Each reading
lands between the previous rate and the rate of the interval just read, so the rate never
overshoots what it is fed. How often it is read changes the result only to second order.
"""

from __future__ import annotations

import math

__all__ = ["SmoothedRate"]


class SmoothedRate:
    """The recent growth rate (per second) of a running total; see the module docstring."""

    __slots__ = ("_last_t", "_last_total", "_weighted_growth", "_weighted_time", "time_constant_s")

    def __init__(self, time_constant_s: float, now: float, total: float = 0.0) -> None:
        if not time_constant_s > 0:
            raise ValueError("the time constant must be more than 0 seconds")
        self.time_constant_s = float(time_constant_s)
        self._last_t = now
        self._last_total = total
        self._weighted_growth = 0.0  # the growth seen, each interval's weighted by its age
        self._weighted_time = 0.0  # the time seen, weighted alike

    @property
    def seconds_seen(self) -> float:
        """The (weighted) time behind the rate: the time since the start while it is short."""
        return self._weighted_time

    def _decayed(self, now: float, total: float) -> tuple[float, float]:
        growth = max(0.0, total - self._last_total)
        elapsed = now - self._last_t
        if elapsed <= 0:
            return self._weighted_growth + growth, self._weighted_time
        keep = math.exp(-elapsed / self.time_constant_s)
        weight = self.time_constant_s * -math.expm1(-elapsed / self.time_constant_s)  # tau (1 - keep)
        return (
            self._weighted_growth * keep + growth * (weight / elapsed),
            self._weighted_time * keep + weight,
        )

    def update(self, now: float, total: float) -> float:
        """The running total is ``total`` at ``now``; the rate with it. A total lower than the
        last one starts the count again from it (a restarted source), with the rate kept."""
        if total < self._last_total:
            self._last_total = total
        if now < self._last_t:
            now = self._last_t  # a clock never runs back; read it as the same moment
        self._weighted_growth, self._weighted_time = self._decayed(now, total)
        self._last_t, self._last_total = now, total
        return self.rate()

    def peek(self, now: float, total: float | None = None) -> float:
        """The rate at ``now`` with the total then (the last one if None), changing nothing."""
        total = self._last_total if total is None or total < self._last_total else total
        growth, seen = self._decayed(max(now, self._last_t), total)
        return growth / seen if seen > 0 else 0.0

    def rate(self) -> float:
        """The rate as of the last update (0 before any time has passed)."""
        return self._weighted_growth / self._weighted_time if self._weighted_time > 0 else 0.0
