"""The batch lifecycle log: one line when a batch is created, starts, and ends (however it ends).

These lines, and errors, are what the server logs at its default level; nothing is logged per
request or per poll. Each record carries structured fields besides its message (``event``,
``batch_id``, counts, ``duration_s``, ``reason``) in ``record.__dict__``, which a JSON formatter
writes as fields (``batchgen-server --log-format json``).

Logger: ``batchgen.batches``. Levels: ``failed`` is a warning, the rest are info.
"""

from __future__ import annotations

import logging
from typing import Any

from batchgen.core.models import Batch, BatchStatus

logger = logging.getLogger("batchgen.batches")

#: The event name of each status a batch is logged entering.
EVENTS: dict[BatchStatus, str] = {
    BatchStatus.IN_PROGRESS: "batch.started",
    BatchStatus.CANCELLING: "batch.cancelling",
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.EXPIRED: "batch.expired",
    BatchStatus.CANCELLED: "batch.cancelled",
}


def log_created(batch: Batch) -> None:
    logger.info(
        "batch %s created: %d requests to %s (model %s)",
        batch.id,
        batch.request_counts.total,
        batch.endpoint,
        batch.model,
        extra={
            "event": "batch.created",
            "batch_id": batch.id,
            "total": batch.request_counts.total,
            "endpoint": batch.endpoint,
        },
    )


def log_transition(batch: Batch, previous: BatchStatus, moment: int) -> None:
    """Log ``batch`` (with its live counters) having moved from ``previous`` at ``moment``."""
    event = EVENTS.get(batch.status)
    if event is None:
        return
    counts = batch.request_counts
    fields: dict[str, Any] = {
        "event": event,
        "batch_id": batch.id,
        "total": counts.total,
        "completed": counts.completed,
        "failed": counts.failed,
    }
    if batch.status is BatchStatus.IN_PROGRESS:
        resumed = previous is not BatchStatus.VALIDATING
        logger.info(
            "batch %s %s: %d requests, %d already done",
            batch.id,
            "resumed" if resumed else "started",
            counts.total,
            counts.completed + counts.failed,
            extra=fields,
        )
        return
    if batch.status is BatchStatus.CANCELLING:
        logger.info("batch %s cancelling", batch.id, extra=fields)
        return
    fields["duration_s"] = moment - batch.created_at
    summary = (
        f"{counts.completed} completed, {counts.failed} failed of {counts.total} in {fields['duration_s']} s"
    )
    if batch.status is BatchStatus.FAILED:
        reason = batch.error.message if batch.error is not None else "unknown"
        fields["reason"] = reason
        logger.warning("batch %s failed: %s (%s)", batch.id, reason, summary, extra=fields)
    else:
        logger.info("batch %s %s: %s", batch.id, batch.status.value, summary, extra=fields)
