"""The batch state machine: the only code that changes a batch's status.

::

    validating ─▶ in_progress ─▶ finalizing ─▶ completed
         │             │              │
         │             │              └──▶ in_progress   (a restart resumes a finalizing batch)
         ├─────────────┴──▶ cancelling ─▶ cancelled
         ├─────────────┴──────────────────▶ failed        (also from finalizing and cancelling)
         └─────────────┴──────────────────▶ expired

A terminal status (completed, failed, expired, cancelled) has no way out: once a client has seen
it, it never changes. ``advance`` is pure; it returns the batch in its new status with that
status's timestamp set (once: a resumed batch keeps its first ``in_progress_at``).
"""

from __future__ import annotations

from typing import Any

import attrs

from batchgen.core.models import Batch, BatchErrorInfo, BatchStatus

_S = BatchStatus

ALLOWED: dict[BatchStatus, frozenset[BatchStatus]] = {
    _S.VALIDATING: frozenset({_S.IN_PROGRESS, _S.CANCELLING, _S.FAILED, _S.EXPIRED}),
    _S.IN_PROGRESS: frozenset({_S.FINALIZING, _S.CANCELLING, _S.FAILED, _S.EXPIRED}),
    _S.FINALIZING: frozenset({_S.COMPLETED, _S.FAILED, _S.IN_PROGRESS}),
    _S.CANCELLING: frozenset({_S.CANCELLED, _S.FAILED}),
    _S.COMPLETED: frozenset(),
    _S.FAILED: frozenset(),
    _S.EXPIRED: frozenset(),
    _S.CANCELLED: frozenset(),
}

#: The timestamp field each status sets when a batch enters it.
TIMESTAMP_FIELD: dict[BatchStatus, str] = {
    _S.IN_PROGRESS: "in_progress_at",
    _S.FINALIZING: "finalizing_at",
    _S.COMPLETED: "completed_at",
    _S.FAILED: "failed_at",
    _S.EXPIRED: "expired_at",
    _S.CANCELLING: "cancelling_at",
    _S.CANCELLED: "cancelled_at",
}


class IllegalTransition(RuntimeError):
    """A move the state machine does not allow (a bug in the caller, never a user error)."""

    def __init__(self, batch: Batch, target: BatchStatus) -> None:
        super().__init__(f"batch {batch.id} cannot go from {batch.status.value} to {target.value}")
        self.source = batch.status
        self.target = target


def can_advance(status: BatchStatus, target: BatchStatus) -> bool:
    return target in ALLOWED[status]


def advance(batch: Batch, target: BatchStatus, *, now: int, error: BatchErrorInfo | None = None) -> Batch:
    """``batch`` in status ``target``; ``error`` is required for, and only for, ``failed``."""
    if not can_advance(batch.status, target):
        raise IllegalTransition(batch, target)
    if (error is not None) != (target is _S.FAILED):
        raise ValueError("a failed batch needs an error, and only a failed batch has one")
    changes: dict[str, Any] = {"status": target}
    stamp = TIMESTAMP_FIELD[target]
    if getattr(batch, stamp) is None:
        changes[stamp] = now
    if error is not None:
        changes["error"] = error
    return attrs.evolve(batch, **changes)
