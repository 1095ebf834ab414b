"""The scheduling pool: the fixed set of slots in which admitted requests run on the backend.

It only counts. A slot is taken when a request is admitted from the intake pool and given back
when that request ends, however it ends; the scheduler guarantees the release.
"""

from __future__ import annotations

from collections import Counter


class SchedulingPool:
    """``capacity`` slots, with the number in use per batch."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("scheduling pool capacity must be at least 1")
        self.capacity = capacity
        self._active = 0
        self._per_batch: Counter[str] = Counter()

    @property
    def active(self) -> int:
        return self._active

    @property
    def free(self) -> int:
        return self.capacity - self._active

    def active_for(self, batch_id: str) -> int:
        return self._per_batch.get(batch_id, 0)

    def acquire(self, batch_id: str) -> None:
        if self._active >= self.capacity:
            raise RuntimeError("no free slot in the scheduling pool")
        self._active += 1
        self._per_batch[batch_id] += 1

    def release(self, batch_id: str) -> None:
        if self._per_batch.get(batch_id, 0) <= 0:
            raise RuntimeError(f"batch {batch_id} holds no slot to release")
        self._active -= 1
        self._per_batch[batch_id] -= 1
        if not self._per_batch[batch_id]:
            del self._per_batch[batch_id]
