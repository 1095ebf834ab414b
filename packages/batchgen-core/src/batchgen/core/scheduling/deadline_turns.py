"""The order in which one tenant's batches take its admissions: earliest deadline first, with a
minimum share for every batch so that none starves.

A ``DeadlineTurns`` holds the batches of one tenant that have queued work. ``preferred`` names
the batch the tenant's next admission goes to:

- normally the batch with the **earliest deadline** (its ``expires_at``); batches with the same
  deadline take turns (round-robin), so batches queued without one (all ``inf``) behave as before
  deadlines existed;
- but while the tenant's batches have more than one deadline, every ``FAIR_TURN_EVERY``-th of its
  admissions is a **fair turn**: it goes to the tenant's least recently admitted batch, whatever
  its deadline.

What that guarantees (``tests/core/test_deadline_scheduling.py`` states it as Hypothesis
state machines):

- No starvation: a batch with queued work is admitted within ``FAIR_TURN_EVERY * m`` admissions
  of its tenant, ``m`` being the most batches that tenant has with queued work meanwhile. Fair
  turns go to batches in least-recently-admitted order, and a batch moves up that order with each
  of them.
- Deadlines: fair turns take at most one admission in ``FAIR_TURN_EVERY`` (at least
  ``FAIR_TURN_EVERY - 1`` other admissions lie between two of them), and the other admissions are
  earliest deadline first, which for requests of equal cost is optimal. So with one slot and
  requests that each take one step, every batch meets its deadline whenever an order exists that
  meets them all on the admissions left once one in ``FAIR_TURN_EVERY`` is set aside.
- Tenants: nothing here changes which tenant an admission goes to (the intake pool decides that
  from the tenants' weights alone), so deadlines never move work between tenants.

The deadline a batch is queued with is its ``deadline_slot``: its ``expires_at`` rounded up to a
grid about an eighth of its window wide (a power of two seconds). Batches whose deadlines are
that close count as having the same one and take turns, so two ``24h`` batches created minutes
apart share their tenant's admissions evenly, as before deadlines existed, while a ``1h`` batch
still goes ahead of a ``7d`` one.

Every step is O(1) but for a batch joining (a heap push) and a batch taken out of its deadline's
turn order (a fair turn, a batch passed over as not admissible, a drop): O(its deadline's batches).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable

__all__ = ["DEADLINE_GRID_SHARE", "FAIR_TURN_EVERY", "DeadlineTurns", "deadline_grid", "deadline_slot"]

#: One admission in this many, of a tenant whose batches have different deadlines, goes to its
#: least recently admitted batch (the minimum share that keeps a far deadline from starving).
FAIR_TURN_EVERY = 8
#: A deadline is rounded up to a grid of about this share of its batch's window (``deadline_slot``).
DEADLINE_GRID_SHARE = 1 / 8


def deadline_grid(window_s: float) -> float:
    """The grid a batch's deadline is rounded to: the power of two seconds at least
    ``DEADLINE_GRID_SHARE`` of its window (one second at the least)."""
    share = window_s * DEADLINE_GRID_SHARE
    return 1.0 if share <= 1 else 2.0 ** math.ceil(math.log2(share))


def deadline_slot(created_at: float, expires_at: float) -> float:
    """The deadline a batch is scheduled by: ``expires_at`` rounded up to its window's grid.

    Deadlines closer than their grid mostly share a slot (and so take turns), and the order of
    deadlines that are further apart is kept: when ``a.expires_at + grid(a) <= b.expires_at``,
    ``a``'s slot is not after ``b``'s.
    """
    grid = deadline_grid(expires_at - created_at)
    return math.ceil(expires_at / grid) * grid


class DeadlineTurns:
    """One tenant's batches with queued work, in deadline order and in admission recency."""

    __slots__ = ("deadlines", "groups", "recency", "since_fair")

    def __init__(self) -> None:
        #: The batches of each deadline, in turn order.
        self.groups: dict[float, deque[str]] = {}
        #: A heap of the groups' deadlines; its first entry is always a deadline with a group.
        self.deadlines: list[float] = []
        #: Every batch, least recently admitted first.
        self.recency: OrderedDict[str, None] = OrderedDict()
        #: Admissions since the last fair turn (counted while there are several deadlines).
        self.since_fair = 0

    def join(self, batch_id: str, deadline: float) -> None:
        """A batch with queued work joins, as the most recently admitted."""
        group = self.groups.get(deadline)
        if group is None:
            group = self.groups[deadline] = deque()
            heapq.heappush(self.deadlines, deadline)
        group.append(batch_id)
        self.recency[batch_id] = None

    def preferred(self) -> tuple[str, bool]:
        """The batch the next admission goes to, and whether it is a fair turn."""
        if self.since_fair >= FAIR_TURN_EVERY - 1 and len(self.groups) > 1:
            return next(iter(self.recency)), True
        return self.groups[self.deadlines[0]][0], False

    def first_admissible(self, admissible: Callable[[str], bool]) -> tuple[str, bool] | None:
        """``preferred`` if ``admissible`` takes it, else the earliest-deadline batch it takes
        (not a fair turn); None when it takes none."""
        batch_id, fair = self.preferred()
        if admissible(batch_id):
            return batch_id, fair
        for deadline in sorted(self.groups):
            for candidate in self.groups[deadline]:
                if admissible(candidate):
                    return candidate, False
        return None

    def took(self, batch_id: str, deadline: float, *, fair: bool, drained: bool = False) -> None:
        """The batch was admitted one request (in a fair turn or not); ``drained``: its last."""
        groups = self.groups
        if fair:
            self.since_fair = 0
        elif len(groups) > 1:
            self.since_fair += 1
        if drained:
            self.leave(batch_id, deadline)
            return
        group = groups[deadline]
        if group[0] == batch_id:
            group.rotate(-1)  # its deadline's next batch has the next turn
        else:  # taken out of its deadline's turn (a fair turn, or the others were not admissible)
            group.remove(batch_id)
            group.append(batch_id)
        self.recency.move_to_end(batch_id)

    def leave(self, batch_id: str, deadline: float) -> None:
        """The batch has no queued work any more (drained or dropped)."""
        group = self.groups[deadline]
        if group[0] == batch_id:
            group.popleft()
        else:
            group.remove(batch_id)
        del self.recency[batch_id]
        if not group:
            del self.groups[deadline]
            while self.deadlines and self.deadlines[0] not in self.groups:
                heapq.heappop(self.deadlines)
