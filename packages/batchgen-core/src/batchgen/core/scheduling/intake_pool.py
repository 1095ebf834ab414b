"""The intake pool: the bounded queue of requests waiting for a slot, fair across tenants, then
across each tenant's batches.

Entries are tiny: per batch it keeps the file's line index (offset and length of each line) and
the positions still to run, never a request body. ``pop`` gives the tenants with queued work turns
in order (deficit round-robin: a tenant of weight ``w`` takes ``w`` requests per round, on
average, when ``w`` is not whole). Within a tenant's turn, its batches are taken earliest deadline
first (``deadline_turns.DeadlineTurns``: batches of the same deadline in turn, and one admission in
``FAIR_TURN_EVERY`` for the tenant's least recently admitted batch, so none starves); batches queued
without a deadline all share one, and so take plain turns. Which tenant takes a turn never depends
on deadlines. A small batch queued behind a huge one of another tenant starts at once instead of
waiting for the huge one to drain; behind one of its own tenant, at once too when its deadline is
nearer, else at its first fair turn.

Within a batch, lines are admitted in the order ``line_order`` gives them when it is queued: the
order asked for (file order for a new batch), with the lines of one prompt prefix made neighbours
when the index carries prefix keys (``prefix_groups``), so an engine's prefix cache computes each
shared prefix once. That order is fixed when the batch is queued and costs ``pop`` nothing; it
changes which of a batch's lines comes next, never which batch or tenant takes a turn.

A batch that was accepted but is not indexed yet holds a **reservation**: room counted against
``free`` from the moment the batch is accepted, so that concurrent creates cannot all be promised
the same places. ``add`` converts a batch's reservation into queued entries; ``release`` (or
``drop``, when the batch fails or is cancelled first) gives the room back.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from batchgen.core.errors import IntakeFull
from batchgen.core.files.batch_file import LineIndex
from batchgen.core.models import DEFAULT_TENANT
from batchgen.core.scheduling.deadline_turns import FAIR_TURN_EVERY, DeadlineTurns
from batchgen.core.scheduling.drain_meter import DrainMeter
from batchgen.core.scheduling.prefix_groups import grouped_by_prefix

__all__ = ["FAIR_TURN_EVERY", "IntakeEntry", "IntakePool", "LineOrder", "line_order"]


class IntakeEntry(NamedTuple):
    """One queued request: which batch, which line, and where that line lies in the input file.

    A named tuple: one is made for every request admitted, so it must be cheap to make.
    """

    batch_id: str
    line: int  # 0-based position among the file's request lines
    offset: int
    length: int


class LineOrder:
    """A batch's line positions to queue, checked and in admission order (``line_order``)."""

    __slots__ = ("positions",)

    def __init__(self, positions: array) -> None:
        self.positions = positions  # array("l")


def line_order(index: LineIndex, lines: Iterable[int] | None = None) -> LineOrder:
    """The positions of ``lines`` (all lines of ``index`` when None), checked (in range, none
    twice) and in the order they are to be admitted: as given, with the lines of one prefix key
    brought together when ``index.prefixes`` is known (``prefix_groups.grouped_by_prefix``).

    A pure function of its arguments, so the caller may run it in a worker thread (a million-line
    batch takes a fraction of a second) and hand the result to ``IntakePool.add``. Raises
    ValueError for a position out of range or given twice.
    """
    pending = array("l", range(len(index)) if lines is None else lines)
    if lines is not None and pending:
        if min(pending) < 0 or max(pending) >= len(index):
            raise ValueError(f"line positions must be in 0..{len(index) - 1}")
        if len(set(pending)) != len(pending):
            raise ValueError("line positions must not repeat")
    if index.prefixes is not None and len(pending) > 1:
        pending = grouped_by_prefix(pending, index.prefixes)
    return LineOrder(pending)


class _BatchQueue:
    __slots__ = ("cursor", "deadline", "lengths", "offsets", "pending", "tenant")

    def __init__(self, index: LineIndex, pending: array, tenant: str, deadline: float) -> None:
        # only the columns a pop reads: the prefix keys, if any, are not kept once queued
        self.offsets = index.offsets
        self.lengths = index.lengths
        self.pending = pending
        self.tenant = tenant
        self.deadline = deadline
        self.cursor = 0

    def __len__(self) -> int:
        return len(self.pending) - self.cursor


class _TenantTurns(DeadlineTurns):
    """A tenant with queued work: its batches in deadline order, and what is left of its turn."""

    __slots__ = ("credit",)

    def __init__(self) -> None:
        super().__init__()
        self.credit = 0.0


class IntakePool:
    """Queued requests of every active batch, at most ``capacity`` in all."""

    def __init__(self, capacity: int, drain: DrainMeter | None = None) -> None:
        """``drain`` measures how fast requests finish, to estimate ``retry_after_s``."""
        if capacity < 1:
            raise ValueError("intake capacity must be at least 1")
        self.capacity = capacity
        self.drain = drain or DrainMeter()
        self._queues: dict[str, _BatchQueue] = {}
        self._tenants: dict[str, _TenantTurns] = {}
        self._tenant_turns: deque[str] = deque()
        self._weights: dict[str, float] = {}
        self._queued_per_tenant: Counter[str] = Counter()
        self._size = 0
        self._reservations: dict[str, int] = {}
        self._reservation_tenants: dict[str, str] = {}
        self._reserved = 0

    @property
    def size(self) -> int:
        """Requests queued now."""
        return self._size

    @property
    def reserved(self) -> int:
        """Places held for accepted batches that are not queued yet."""
        return self._reserved

    @property
    def free(self) -> int:
        return self.capacity - self._size - self._reserved

    def reserved_for(self, batch_id: str) -> int:
        return self._reservations.get(batch_id, 0)

    # --- tenants ---------------------------------------------------------------------------
    def set_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share of admissions while other tenants have queued work too (default 1)."""
        if not 0 < weight < float("inf"):
            raise ValueError(f"a tenant's weight must be above 0, got {weight}")
        self._weights[tenant] = weight

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def queued_for_tenant(self, tenant: str) -> int:
        """Requests of the tenant's batches queued now, plus the places its accepted batches hold."""
        held = sum(
            count
            for batch_id, count in self._reservations.items()
            if self._reservation_tenants[batch_id] == tenant
        )
        return self._queued_per_tenant.get(tenant, 0) + held

    def tenants_queued(self) -> dict[str, int]:
        """Queued requests (and held places) per tenant that has any."""
        totals = Counter(self._queued_per_tenant)
        for batch_id, count in self._reservations.items():
            totals[self._reservation_tenants[batch_id]] += count
        return {tenant: count for tenant, count in totals.items() if count}

    def tenant_of(self, batch_id: str) -> str | None:
        """The tenant of a queued batch (or one holding places), or None."""
        queue = self._queues.get(batch_id)
        return queue.tenant if queue is not None else self._reservation_tenants.get(batch_id)

    def retry_after_s(self, requests: int) -> int:
        """Seconds until ``requests`` places are likely free, at the current drain rate (1..300)."""
        return self.drain.wait_for(requests - self.free)

    def reserve(self, batch_id: str, requests: int, tenant: str = DEFAULT_TENANT) -> None:
        """Hold ``requests`` places for a batch until ``add`` queues it or ``release`` gives them back.

        Raises IntakeFull, holding nothing, when they do not fit now.
        """
        if requests < 0:
            raise ValueError("a reservation cannot be negative")
        if batch_id in self._reservations or batch_id in self._queues:
            raise ValueError(f"batch {batch_id} already holds room in the intake pool")
        if requests > self.free:
            raise IntakeFull(
                f"The intake pool has room for {self.free} more requests; this batch has {requests}.",
                retry_after_s=self.retry_after_s(requests),
            )
        self._reservations[batch_id] = requests
        self._reservation_tenants[batch_id] = tenant
        self._reserved += requests

    def release(self, batch_id: str) -> int:
        """Give back a batch's reservation (it failed or was cancelled before it was queued)."""
        held = self._reservations.pop(batch_id, 0)
        self._reservation_tenants.pop(batch_id, None)
        self._reserved -= held
        return held

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._queues

    def queued(self, batch_id: str) -> int:
        queue = self._queues.get(batch_id)
        return 0 if queue is None else len(queue)

    def add(
        self,
        batch_id: str,
        index: LineIndex,
        lines: Iterable[int] | LineOrder | None = None,
        tenant: str | None = None,
        deadline: float | None = None,
    ) -> int:
        """Queue ``lines`` (all lines of ``index`` when None) of a batch; return how many.

        They are admitted in ``line_order(index, lines)``; a ``LineOrder`` already made for this
        index (off the event loop) is taken as it is.

        The batch belongs to ``tenant`` (default: the tenant its reservation was made for, else
        the default tenant). Among its tenant's batches, the one with the earliest ``deadline``
        (the batch's ``expires_at``; None: later than any) is admitted first (``DeadlineTurns``).

        The batch's reservation, if it holds one, is converted: the queued requests take its
        places, and any it held beyond them are given back. Raises IntakeFull, queueing nothing
        and keeping the reservation, when they do not all fit.
        """
        if batch_id in self._queues:
            raise ValueError(f"batch {batch_id} is already queued")
        due = math.inf if deadline is None else float(deadline)
        if math.isnan(due):
            raise ValueError("a deadline must be a number")
        pending = (lines if isinstance(lines, LineOrder) else line_order(index, lines)).positions
        room = self.free + self.reserved_for(batch_id)
        if len(pending) > room:
            raise IntakeFull(
                f"The intake pool has room for {room} more requests; this batch has {len(pending)}.",
                retry_after_s=self.drain.wait_for(len(pending) - room),
            )
        if tenant is None:
            tenant = self._reservation_tenants.get(batch_id, DEFAULT_TENANT)
        self.release(batch_id)
        if not pending:
            return 0
        self._queues[batch_id] = _BatchQueue(index, pending, tenant, due)
        turns = self._tenants.get(tenant)
        if turns is None:
            turns = self._tenants[tenant] = _TenantTurns()
            self._tenant_turns.append(tenant)
        turns.join(batch_id, due)
        self._size += len(pending)
        self._queued_per_tenant[tenant] += len(pending)
        return len(pending)

    def queued_batches(self) -> Iterable[str]:
        """The batches with queued requests."""
        return self._queues.keys()

    def pop(self, admissible: Callable[[str], bool] | None = None) -> IntakeEntry | None:
        """Take the next request: tenants with queued work take turns (each as many requests as
        its weight), and within a tenant's turn its batches go earliest deadline first, with the
        fair turns of ``DeadlineTurns``.

        With ``admissible`` (the scheduler's fair shares between models), batches it refuses are
        passed over: the first tenant in turn with an admissible batch takes its turn now with
        that batch (tenants passed over had nothing they could run); None when no queued batch is
        admissible.
        """
        if not self._tenant_turns:
            return None
        if admissible is not None:
            found = self._bring_forward(admissible)
            if found is None:
                return None
            batch_id, fair = found
            tenant = self._tenant_turns[0]
            turns = self._tenants[tenant]
        else:
            while True:
                tenant = self._tenant_turns[0]
                turns = self._tenants[tenant]
                if turns.credit >= 1:
                    break
                turns.credit += self._weights.get(tenant, 1.0)  # its turn begins
                if turns.credit >= 1:
                    break
                self._tenant_turns.rotate(-1)  # a weight below 1 saves up over rounds
            if len(turns.groups) > 1:
                batch_id, fair = turns.preferred()
            else:  # one deadline (the common case, inlined): its batches take turns
                batch_id, fair = turns.groups[turns.deadlines[0]][0], False
        queue = self._queues[batch_id]
        line = queue.pending[queue.cursor]
        queue.cursor += 1
        self._size -= 1
        self._queued_per_tenant[tenant] -= 1
        turns.credit -= 1
        if not len(queue):
            turns.took(batch_id, queue.deadline, fair=fair, drained=True)
            del self._queues[batch_id]
        elif admissible is not None or len(turns.groups) > 1:
            turns.took(batch_id, queue.deadline, fair=fair)
        else:  # one deadline, and the batch took its turn: ``took``, inlined
            turns.groups[queue.deadline].rotate(-1)
            turns.recency.move_to_end(batch_id)
        if not turns.recency:
            self._forget_tenant(tenant)
        elif turns.credit < 1:
            self._tenant_turns.rotate(-1)
        return IntakeEntry(batch_id, line, queue.offsets[line], queue.lengths[line])

    def _bring_forward(self, admissible: Callable[[str], bool]) -> tuple[str, bool] | None:
        """Put the first tenant (in turn order) with an admissible batch first, with credit for
        one request, and return that batch (the one it prefers, if admissible, else its earliest
        admissible one) and whether it takes a fair turn; None when there is none."""
        for position, tenant in enumerate(self._tenant_turns):
            turns = self._tenants[tenant]
            found = turns.first_admissible(admissible)
            if found is None:
                continue
            self._tenant_turns.rotate(-position)
            turns.credit = max(turns.credit, 1.0)
            return found
        return None

    def _forget_tenant(self, tenant: str) -> None:
        """A tenant whose last queued request left: out of the turns (its weight is kept)."""
        del self._tenants[tenant]
        self._tenant_turns.remove(tenant)
        del self._queued_per_tenant[tenant]

    def drop(self, batch_id: str) -> int:
        """Remove every queued request of a batch and release its reservation; return how many
        queued requests were dropped."""
        self.release(batch_id)
        queue = self._queues.pop(batch_id, None)
        if queue is None:
            return 0
        turns = self._tenants[queue.tenant]
        turns.leave(batch_id, queue.deadline)
        dropped = len(queue)
        self._size -= dropped
        self._queued_per_tenant[queue.tenant] -= dropped
        if not turns.recency:
            self._forget_tenant(queue.tenant)
        return dropped
