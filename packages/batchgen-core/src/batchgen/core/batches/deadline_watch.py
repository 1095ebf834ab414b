"""Whether each running batch will finish by its deadline, and the one event when it will not.

A batch's deadline is its ``expires_at`` (created + its completion window). ``will_miss`` is the
rule, from the batch's measured pace (``batches.progress``: the exponentially weighted rate of its
finished requests, ``SmoothedRate``): a running batch is **at risk** when

- its estimated completion (``estimated_completion_at``: now + requests left / pace) falls after
  ``expires_at``; or
- its pace is known and zero (nothing finished since it began, or since a restart), and it has
  waited longer than the time it has left (past the middle of its window with nothing done).

An unknown pace (the batch's first second) says nothing: not at risk. The flag is live: a batch
that speeds up is no longer at risk. The tracker puts it on every running batch's snapshot
(``at_risk`` in the batch object).

``DeadlineWatch.check`` runs as a maintenance job. The first time it finds a batch at risk it
records the moment (``at_risk_at``, a stored column) and saves it in one write with the
``batch.at_risk`` webhook event for each of the batch's webhook URLs (the outbox,
``webhook_outbox``), so the event is made once per batch, whatever stops the process: a restart
reads ``at_risk_at`` back and makes no second one; a save the store refuses makes neither, and is
tried again at the next check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import attrs

from batchgen.core.batches.progress import ProgressEstimate
from batchgen.core.ids import new_object_id
from batchgen.core.models import Batch, BatchStatus
from batchgen.core.webhook_outbox import OutboxMessage, WebhookTargets, event_body

if TYPE_CHECKING:
    from batchgen.core.batches.tracker import BatchTracker

__all__ = ["AT_RISK_EVENT", "DeadlineWatch", "at_risk_messages", "will_miss"]

logger = logging.getLogger("batchgen.service")

#: The webhook event type made when a batch is first found at risk.
AT_RISK_EVENT = "batch.at_risk"
_WATCHED = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS})


def will_miss(batch: Batch, progress: ProgressEstimate, now: float) -> bool:
    """Whether ``batch`` (its counters live), at the pace ``progress`` measured, will not finish by
    its ``expires_at`` (the rule of the module docstring)."""
    counts = batch.request_counts
    if batch.status not in _WATCHED or counts.completed + counts.failed >= counts.total:
        return False
    if progress.completion_at is not None:
        return progress.completion_at > batch.expires_at
    if progress.requests_per_second == 0:  # known, and nothing finished
        began = batch.in_progress_at if batch.in_progress_at is not None else batch.created_at
        return now - began > batch.expires_at - now
    return False


def at_risk_messages(targets: WebhookTargets, batch: Batch, now: int) -> Sequence[OutboxMessage]:
    """The ``batch.at_risk`` event for each of the batch's webhook URLs (none without a URL)."""
    urls = targets.for_batch(batch)
    if not urls:
        return ()
    event_id = new_object_id("evt_")
    body = event_body(event_id, AT_RISK_EVENT, batch.id, now)
    return tuple(OutboxMessage(event_id, url, body, now, next_attempt_at=float(now)) for url in urls)


class DeadlineWatch:
    """Finds running batches at risk of missing their deadline; marks each once, with its event."""

    def __init__(self, tracker: BatchTracker, targets: WebhookTargets) -> None:
        self._tracker = tracker
        self._targets = targets

    def at_risk(self) -> int:
        """Batches at risk now (what ``/metrics`` reports)."""
        return sum(1 for active in self._tracker if active.snapshot().at_risk)

    def check(self) -> None:
        """Mark every batch that is at risk now and was never marked: ``at_risk_at`` and its event,
        saved together."""
        for active in self._tracker:
            if active.batch.at_risk_at is not None or active.status not in _WATCHED:
                continue
            seen = active.snapshot()
            if not seen.at_risk:
                continue
            moment = int(time.time())
            active.batch = attrs.evolve(active.batch, at_risk_at=moment)
            if not self._tracker.persist(active, at_risk_messages(self._targets, active.batch, moment)):
                # neither the mark nor the event was saved: both are made again at the next check
                active.batch = attrs.evolve(active.batch, at_risk_at=None)
                continue
            logger.warning(
                "batch %s is at risk of missing its deadline: %d of %d requests left, estimated to end "
                "at %s, its completion window (%s) ends at %s",
                active.id,
                seen.request_counts.total - seen.request_counts.completed - seen.request_counts.failed,
                seen.request_counts.total,
                readable_time(seen.progress.completion_at, moment),
                seen.completion_window,
                readable_time(seen.expires_at, moment),
            )


def readable_time(unix_s: float | None, now_s: float) -> str:
    """A moment for a log line: UTC to the second, and how far from ``now_s`` it is
    (``2026-12-07 04:10:00 UTC, in 1h 5m``); "an unknown time" for None."""
    if unix_s is None:
        return "an unknown time"
    moment = datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    seconds = round(abs(unix_s - now_s))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    span = " ".join(
        f"{value}{unit}" for value, unit in ((hours, "h"), (minutes, "m"), (seconds, "s")) if value
    )
    if not span:
        return f"{moment}, now"
    return f"{moment}, in {span}" if unix_s > now_s else f"{moment}, {span} ago"
