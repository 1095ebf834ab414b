"""The pure policies of the ``openai`` backend: how many requests each upstream gets, and when it is down.

Nothing here does I/O or reads a clock; times are passed in. The backend asks, these classes answer:

``AdaptiveLimit``     AIMD concurrency limit of one upstream. Starts low; while every slot is in use
                      and requests succeed it grows (doubling per window of successes until the first
                      overload, then by one per window); on an overload signal (429, 5xx, timeout,
                      connection error) it halves, at most once per window, so a burst of failures
                      from one congestion event halves it once, not once per request.
``UpstreamHealth``    up or down. Down after ``failures_to_mark_down`` consecutive failures; a down
                      upstream is probed again after ``probe_interval_s``, doubling up to
                      ``max_probe_interval_s`` while probes fail.
``UpstreamState``     one upstream's limit, health and in-flight count.
``choose_upstream``   where the next attempt of a request goes: among the up upstreams with a free
                      slot, the one this request tried least, then the least loaded relative to its
                      limit; None when every up upstream is full (the attempt waits).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from batchgen.core.url_redaction import redact_url


@attrs.frozen
class Ticket:
    """What ``AdaptiveLimit.ticket`` hands to one attempt; given back with its outcome."""

    epoch: int
    saturated: bool


@attrs.define
class AdaptiveLimit:
    """Additive-increase, multiplicative-decrease concurrency limit of one upstream."""

    maximum: int
    initial: int = 4
    minimum: int = 1
    limit: int = attrs.field(init=False)
    slow_start: bool = attrs.field(init=False, default=True)
    epoch: int = attrs.field(init=False, default=0)
    _successes: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.minimum < 1 or self.maximum < self.minimum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {self.minimum} and {self.maximum}")
        self.reset()

    def reset(self) -> None:
        """Back to the initial limit, as for an upstream seen for the first time."""
        self.limit = max(self.minimum, min(self.initial, self.maximum))
        self.slow_start = True
        self._successes = 0
        self.epoch += 1

    def ticket(self, in_flight: int) -> Ticket:
        """A ticket for an attempt that makes ``in_flight`` requests in flight (itself included)."""
        return Ticket(self.epoch, saturated=in_flight >= self.limit)

    def on_success(self, ticket: Ticket) -> None:
        """Grow after a full window (``limit`` successes) of attempts sent while every slot was used.

        Successes while the upstream had free slots say nothing about whether it could take more,
        so they do not count.
        """
        if not ticket.saturated or self.limit >= self.maximum:
            return
        self._successes += 1
        if self._successes >= self.limit:
            self._successes = 0
            self.limit = min(self.maximum, self.limit * 2 if self.slow_start else self.limit + 1)

    def on_overload(self, ticket: Ticket) -> bool:
        """Halve the limit, unless it was already cut after this attempt started; True if cut."""
        if ticket.epoch != self.epoch:
            return False
        self.limit = max(self.minimum, self.limit // 2)
        self.slow_start = False
        self._successes = 0
        self.epoch += 1
        return True


@attrs.define
class UpstreamHealth:
    """Whether an upstream is up, why not, and when to probe it again."""

    failures_to_mark_down: int = 3
    probe_interval_s: float = 1.0
    max_probe_interval_s: float = 30.0
    down: bool = False
    consecutive_failures: int = 0
    last_error: str | None = None
    next_probe_at: float = 0.0
    _interval: float = attrs.field(init=False, default=0.0)

    def on_success(self) -> None:
        """A request succeeded: the upstream is up (again)."""
        self.down = False
        self.consecutive_failures = 0

    def on_failure(self, error: str, now: float) -> bool:
        """A request failed in a way that says the upstream may be broken; True if it is now down."""
        self.consecutive_failures += 1
        self.last_error = error
        if not self.down and self.consecutive_failures >= self.failures_to_mark_down:
            self.mark_down(error, now)
            return True
        return False

    def mark_down(self, error: str, now: float) -> None:
        self.down = True
        self.last_error = error
        self._interval = self.probe_interval_s
        self.next_probe_at = now + self._interval

    def probe_due(self, now: float) -> bool:
        return self.down and now >= self.next_probe_at

    def on_probe_failure(self, error: str, now: float) -> None:
        self.last_error = error
        self._interval = min(self.max_probe_interval_s, max(self._interval, self.probe_interval_s) * 2)
        self.next_probe_at = now + self._interval

    def on_probe_success(self) -> None:
        self.on_success()


@attrs.define
class UpstreamState:
    """One upstream as the scheduler of the ``openai`` backend sees it."""

    url: str = attrs.field(repr=redact_url)
    limit: AdaptiveLimit
    health: UpstreamHealth
    in_flight: int = 0
    #: Failed attempts since start (overloads, errors, timeouts, bad answers), for monitoring.
    failures: int = 0

    @property
    def load(self) -> float:
        """Requests in flight relative to the current limit (1.0 = full)."""
        return self.in_flight / self.limit.limit

    @property
    def has_room(self) -> bool:
        return not self.health.down and self.in_flight < self.limit.limit


def choose_upstream(
    upstreams: Sequence[UpstreamState],
    tried: Mapping[int, int] | None = None,
    eligible: Collection[int] | None = None,
) -> int | None:
    """Index of the upstream the next attempt goes to, or None if it has to wait for a free slot.

    With ``eligible``, only those upstreams are considered (the ones serving the request's model).

    Only up upstreams with a free slot are candidates. ``tried`` counts the attempts this request
    already made on each upstream: the one it tried least wins, then the least loaded relative to
    its limit, then the first listed. So retries go round the upstreams instead of back to the
    one that just failed, whenever another has room.
    """
    tried = tried or {}
    room = [
        index
        for index, upstream in enumerate(upstreams)
        if upstream.has_room and (eligible is None or index in eligible)
    ]
    if not room:
        return None
    return min(room, key=lambda index: (tried.get(index, 0), upstreams[index].load))


def free_slots(upstreams: Sequence[UpstreamState]) -> int:
    """Free slots over the up upstreams: how many waiting attempts could start now."""
    return sum(max(0, u.limit.limit - u.in_flight) for u in upstreams if not u.health.down)


def all_down(upstreams: Sequence[UpstreamState]) -> bool:
    return all(upstream.health.down for upstream in upstreams)
