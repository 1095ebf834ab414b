"""ThroughputMeter: the service's running totals of finished requests and tokens since it started.

A dashboard turns two readings of the totals into requests and tokens per second. The meter is
told each tracked batch's counters whenever they may have moved (``observe``) and adds what moved
since it last looked, so it needs no call per outcome: a batch is ``start``-ed with the counts it
already has (zero, or what a restart rebuilt from its result files, which are not new work), and
``stop``-ped when it leaves the tracker. Totals start at zero with the process and never go down.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Totals:
    """Requests that ended with a result line or an error line, and the tokens of the results."""

    requests_completed: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "requests_completed_total": self.requests_completed,
            "requests_failed_total": self.requests_failed,
            "prompt_tokens_total": self.prompt_tokens,
            "completion_tokens_total": self.completion_tokens,
        }


def _grown(now: Totals, before: Totals) -> Totals:
    """What each counter gained (never a negative amount)."""
    return Totals(*(max(0, a - b) for a, b in zip(attrs.astuple(now), attrs.astuple(before), strict=True)))


def _plus(a: Totals, b: Totals) -> Totals:
    return Totals(*(x + y for x, y in zip(attrs.astuple(a), attrs.astuple(b), strict=True)))


class ThroughputMeter:
    """Running totals over every batch this process has worked on."""

    def __init__(self) -> None:
        self.totals = Totals()
        self._seen: dict[str, Totals] = {}

    def start(self, batch_id: str, counts: Totals) -> None:
        """Follow a batch from ``counts`` on (they are not added)."""
        self._seen[batch_id] = counts

    def observe(self, batch_id: str, counts: Totals) -> None:
        """Add what the batch's counters gained since it was last seen; a batch not followed
        (never started, or stopped) is ignored."""
        before = self._seen.get(batch_id)
        if before is None or before == counts:
            return
        self.totals = _plus(self.totals, _grown(counts, before))
        self._seen[batch_id] = counts

    def stop(self, batch_id: str, counts: Totals) -> None:
        """Take the batch's last counts and stop following it."""
        self.observe(batch_id, counts)
        self._seen.pop(batch_id, None)
