"""What the service counts for monitoring: finished requests, tokens, and two latency histograms.

``RequestTelemetry`` is plain integers and bucket lists, updated on the event loop's thread at the
few points where a request is admitted to a slot or finishes: a few additions each, no lock, no
allocation. An exporter reads it when it is scraped (the server's ``/metrics``, through
prometheus-client); an embedding pipeline can read the same attributes. Counts start at zero with
each process, as Prometheus counters may.

- ``requests_admitted(batch_id, count)``: requests left the intake pool for slots together; their
  queue wait (since their batch was queued, ``batch_queued``) goes into ``queue_wait``.
- ``request_completed`` / ``request_failed``: its output or error line was written (with its
  tokens, and the prompt tokens the engine's prefix cache served).
- ``backend_calls(seconds, count)``: time a group's requests spent inside the backend
  (``backend_latency``).

``throughput`` (a ``Throughput``) turns the running totals into smoothed rates for the pool
status: requests finished and tokens generated per second, exponentially weighted over
``RATE_TIME_CONSTANT_S``, read whenever someone asks.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence

from batchgen.core.smoothed_rate import SmoothedRate

#: Upper bounds (seconds) of the backend latency histogram: a few ms (simulated) to many minutes.
BACKEND_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Upper bounds (seconds) of the queue wait histogram: at once, up to a day (a batch's window).
QUEUE_WAIT_BUCKETS_S = (0.01, 0.1, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 21600, 43200, 86400)
#: The time constant (seconds) of the pool status's requests/s and tokens/s.
RATE_TIME_CONSTANT_S = 30.0


class Histogram:
    """Counts per bucket (``counts[i]``: values at most ``bounds[i]``, not cumulative; the last
    one: above every bound) and the sum of the values."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(bound) for bound in bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("histogram bounds must increase")
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Count ``value`` (``times`` times: a group of requests that took as long)."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, values at most it) per bucket, ending with (inf, every value)."""
        running = 0
        pairs: list[tuple[float, int]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            pairs.append((bound, running))
        return pairs


class Throughput:
    """Requests finished and tokens generated per second, smoothed (``SmoothedRate``)."""

    __slots__ = ("_clock", "_requests", "_tokens")

    def __init__(
        self, time_constant_s: float = RATE_TIME_CONSTANT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        started = clock()
        self._requests = SmoothedRate(time_constant_s, started)
        self._tokens = SmoothedRate(time_constant_s, started)

    @property
    def time_constant_s(self) -> float:
        return self._requests.time_constant_s

    def read(self, requests_total: int, tokens_total: int) -> tuple[float, float]:
        """(requests/s, tokens/s) with the running totals as they are now."""
        moment = self._clock()
        return self._requests.update(moment, requests_total), self._tokens.update(moment, tokens_total)


class RequestTelemetry:
    """Counters and histograms of the requests this process ran."""

    __slots__ = (
        "_clock",
        "_queued_at",
        "backend_latency",
        "completed",
        "failed",
        "generated_tokens",
        "prefix_cached_tokens",
        "prompt_tokens",
        "queue_wait",
        "throughput",
    )

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.completed = 0
        self.failed = 0
        self.prompt_tokens = 0
        #: Of ``prompt_tokens``, those the engines' prefix caches served (as the backends report).
        self.prefix_cached_tokens = 0
        self.generated_tokens = 0
        self.backend_latency = Histogram(BACKEND_LATENCY_BUCKETS_S)
        self.queue_wait = Histogram(QUEUE_WAIT_BUCKETS_S)
        self._queued_at: dict[str, float] = {}
        self.throughput = Throughput(clock=clock)

    def batch_queued(self, batch_id: str) -> None:
        """The batch's requests were queued in the intake pool now."""
        self._queued_at[batch_id] = self._clock()

    def batch_ended(self, batch_id: str) -> None:
        self._queued_at.pop(batch_id, None)

    def requests_admitted(self, batch_id: str, count: int) -> None:
        """``count`` requests of the batch were admitted together (one clock reading for all)."""
        queued_at = self._queued_at.get(batch_id)
        if queued_at is not None:
            self.queue_wait.observe(self._clock() - queued_at, count)

    def backend_calls(self, seconds: float, count: int) -> None:
        """``count`` requests of one group ended after ``seconds`` inside the backend."""
        if count:
            self.backend_latency.observe(seconds, count)

    def request_completed(
        self, prompt_tokens: int, generated_tokens: int, prefix_cached_tokens: int = 0
    ) -> None:
        self.completed += 1
        self.prompt_tokens += prompt_tokens
        self.prefix_cached_tokens += prefix_cached_tokens
        self.generated_tokens += generated_tokens

    def request_failed(self) -> None:
        self.failed += 1
