"""Global intake: what every replica together may have accepted, and why a new batch does not fit.

Several replicas share one intake. A batch is admitted (``PostgresShardLedger.add_batch`` with
``limits``) under one advisory lock in the database, so two replicas can never both admit past a
limit. What counts is the work not finished yet: the lines of running batches not committed yet,
overall and for the batch's tenant, and the tenant's running batches. This module is the pure
part: the limits, what the ledger holds when a batch asks, and the decision.
"""

from __future__ import annotations

import attrs

__all__ = ["CAPACITY", "TENANT_ACTIVE", "TENANT_QUEUED", "IntakeFull", "IntakeHeld", "IntakeLimits"]

#: Why a batch was refused: the intake as a whole, the tenant's queued lines, its running batches.
CAPACITY, TENANT_QUEUED, TENANT_ACTIVE = "capacity", "tenant_queued", "tenant_active"


def _bound(_instance: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and not 0 <= value <= 2**62:
        raise ValueError(f"{attribute.name} must be at least 0 and at most 2**62, not {value!r}")


@attrs.frozen
class IntakeLimits:
    """What all replicas together may hold (None: no limit of that kind)."""

    #: Lines of running batches not committed yet, over every tenant.
    capacity: int | None = attrs.field(default=None, validator=_bound)
    #: The same, for one tenant.
    tenant_queued: int | None = attrs.field(default=None, validator=_bound)
    #: Running batches of one tenant.
    tenant_active: int | None = attrs.field(default=None, validator=_bound)


@attrs.frozen
class IntakeHeld:
    """What the ledger holds when a batch asks to be admitted."""

    queued: int
    tenant_queued: int
    tenant_active: int

    def refusal(self, limits: IntakeLimits, tenant: str, lines: int) -> tuple[str, str] | None:
        """(reason, message) when a batch of ``lines`` for ``tenant`` does not fit now, else None."""
        if limits.capacity is not None and self.queued + lines > limits.capacity:
            return CAPACITY, (
                f"the intake holds {self.queued} unfinished requests of its {limits.capacity}, "
                f"so {lines} more do not fit now"
            )
        if limits.tenant_queued is not None and self.tenant_queued + lines > limits.tenant_queued:
            return TENANT_QUEUED, (
                f"tenant '{tenant}' has {self.tenant_queued} unfinished requests of its "
                f"{limits.tenant_queued}, so {lines} more do not fit now"
            )
        if limits.tenant_active is not None and self.tenant_active + 1 > limits.tenant_active:
            return TENANT_ACTIVE, (f"tenant '{tenant}' has {self.tenant_active} running batches, its limit")
        return None


class IntakeFull(Exception):
    """A batch that does not fit the global intake now; nothing was recorded. ``reason`` is one
    of ``CAPACITY``, ``TENANT_QUEUED``, ``TENANT_ACTIVE``; ``held`` what was held then."""

    def __init__(self, reason: str, message: str, held: IntakeHeld) -> None:
        super().__init__(message)
        self.reason = reason
        self.held = held
