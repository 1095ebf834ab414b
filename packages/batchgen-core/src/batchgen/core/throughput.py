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


#: A batch's counters as the tracker holds them: completed, failed, prompt and completion tokens.
Counts = tuple[int, int, int, int]


class ThroughputMeter:
    """Running totals over every batch this process has worked on (cheap: called per request)."""

    def __init__(self) -> None:
        self._totals = [0, 0, 0, 0]
        self._seen: dict[str, Counts] = {}

    @property
    def totals(self) -> Totals:
        return Totals(*self._totals)

    def start(self, batch_id: str, counts: Counts) -> None:
        """Follow a batch from ``counts`` on (they are not added)."""
        self._seen[batch_id] = counts

    def observe(self, batch_id: str, counts: Counts) -> None:
        """Add what the batch's counters gained since it was last seen; a batch not followed
        (never started, or stopped) is ignored, and a counter never adds a negative amount."""
        before = self._seen.get(batch_id)
        if before is None or before == counts:
            return
        totals = self._totals
        for index, (now, then) in enumerate(zip(counts, before, strict=True)):
            if now > then:
                totals[index] += now - then
        self._seen[batch_id] = counts

    def stop(self, batch_id: str, counts: Counts) -> None:
        """Take the batch's last counts and stop following it."""
        self.observe(batch_id, counts)
        self._seen.pop(batch_id, None)
