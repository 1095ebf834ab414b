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
``choose_upstream``   where the next attempt of a request goes: a first attempt with a prompt
                      prefix key goes to its prefix's upstream (``prefix_home``) when that one has
                      a free slot; otherwise, among the up upstreams with a free slot, the one this
                      request tried least, then the least loaded relative to its limit; None when
                      every up upstream is full (the attempt waits).
``prefix_home``       the upstream a prefix key belongs to: rendezvous (highest random weight)
                      hashing over the up upstreams serving the request's model, so the requests of
                      one prefix meet one engine's prefix cache, and adding, removing or losing an
                      upstream moves only the prefixes whose highest weight it has or had.
``affinity_outcome``  what became of a prefix's affinity for one request: ``kept`` (it went to
                      the prefix's upstream), ``down`` (that upstream was down: the next one by
                      weight took it if it had room), ``saturated`` (it was full: the request went
                      where it would have gone without a prefix).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence

import attrs

from batchgen.core.url_redaction import redact_url

KEPT, DOWN, SATURATED = "kept", "down", "saturated"
#: What became of a prefix's affinity for one request (``affinity_outcome``).
AFFINITY_OUTCOMES = (KEPT, DOWN, SATURATED)
_MASK64 = (1 << 64) - 1


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
    #: Requests of the prefixes whose upstream this is, by ``affinity_outcome``, for monitoring.
    affinity: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(AFFINITY_OUTCOMES, 0))
    #: A 64-bit number of the URL, mixed with a prefix key to give this upstream's weight for it.
    seed: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        digest = hashlib.blake2b(self.url.encode(), digest_size=8).digest()
        self.seed = int.from_bytes(digest, "little")

    @property
    def load(self) -> float:
        """Requests in flight relative to the current limit (1.0 = full)."""
        return self.in_flight / self.limit.limit

    @property
    def has_room(self) -> bool:
        return not self.health.down and self.in_flight < self.limit.limit


def _weight(seed: int, prefix: int) -> int:
    """An upstream's rendezvous weight for a prefix key: splitmix64's finaliser of the two mixed,
    so each upstream orders the keys independently of the others."""
    value = (seed ^ (prefix & _MASK64)) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def prefix_home(
    upstreams: Sequence[UpstreamState],
    prefix: int,
    eligible: Collection[int] | None = None,
    *,
    up_only: bool = True,
) -> int | None:
    """The upstream a prefix key belongs to: of the ``eligible`` upstreams (all when None) that
    are up (any, with ``up_only=False``), the one with the highest weight for the key, whether
    it has room or not; None when there is none."""
    best: int | None = None
    best_weight = -1
    for index, upstream in enumerate(upstreams):
        if (eligible is not None and index not in eligible) or (up_only and upstream.health.down):
            continue
        weight = _weight(upstream.seed, prefix)
        if weight > best_weight:
            best, best_weight = index, weight
    return best


def affinity_outcome(
    upstreams: Sequence[UpstreamState], prefix: int, chosen: int, eligible: Collection[int] | None = None
) -> tuple[int, str]:
    """For a first attempt of a request with a prefix key that went to ``chosen``: the prefix's
    own upstream (``prefix_home`` over every eligible one, up or down) and what became of its
    affinity (``KEPT``, ``DOWN`` or ``SATURATED``)."""
    home = prefix_home(upstreams, prefix, eligible, up_only=False)
    assert home is not None  # ``chosen`` is eligible
    if chosen == home:
        return home, KEPT
    if upstreams[home].health.down:
        return home, DOWN
    return home, SATURATED


def choose_upstream(
    upstreams: Sequence[UpstreamState],
    tried: Mapping[int, int] | None = None,
    eligible: Collection[int] | None = None,
    prefix: int | None = None,
) -> int | None:
    """Index of the upstream the next attempt goes to, or None if it has to wait for a free slot.

    With ``eligible``, only those upstreams are considered (the ones serving the request's model).

    A first attempt (nothing ``tried``) with a ``prefix`` key goes to ``prefix_home``, the up
    upstream its prefix belongs to, when that one has a free slot. Otherwise only up upstreams
    with a free slot are candidates. ``tried`` counts the attempts this request already made on
    each upstream: the one it tried least wins, then the least loaded relative to its limit, then
    the first listed. So retries go round the upstreams instead of back to the one that just
    failed, whenever another has room, and a prefix whose upstream is full spills over to the
    least loaded one rather than waiting.
    """
    if prefix is not None and not tried:
        home = prefix_home(upstreams, prefix, eligible)
        if home is not None and upstreams[home].has_room:
            return home
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
