"""The scheduler: moves requests from the intake pool into free slots of the scheduling pool and runs them.

The decisions are synchronous and small (``admit`` fills free slots in the intake pool's fair
order; ``finish`` frees a slot) so they can be tested directly. ``run`` is the async loop that
starts a task for each admitted request; a request's task always releases its slot, whatever the
request did, refills it from the intake pool in the same step, and runs that next request itself,
so a busy scheduler creates no task per request.

The loop stays responsive under load: ``run`` starts at most ``ADMIT_PER_TURN`` tasks per turn of
the event loop, and every request task asks the ``Pacer`` for a turn before each request, so
thousands of requests that need no I/O cannot hold the loop for long. Each finished request is
counted on the intake pool's drain meter (the basis of ``Retry-After`` when the pool is full).

With several served models, ``shares`` (``ModelShares``) keeps any one model from holding more
than its fair share of the slots while another model has queued work.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import anyio.lowlevel

from batchgen.core.scheduling.intake_pool import IntakeEntry, IntakePool
from batchgen.core.scheduling.model_shares import ModelShares
from batchgen.core.scheduling.pacer import Pacer
from batchgen.core.scheduling.scheduling_pool import SchedulingPool

logger = logging.getLogger("batchgen.scheduler")

RequestRunner = Callable[[IntakeEntry], Awaitable[None]]

#: The most request tasks ``run`` starts in one turn of the event loop.
ADMIT_PER_TURN = 256


class Scheduler:
    """Admits queued requests into free slots and runs each on ``run_request``."""

    def __init__(
        self,
        intake_pool: IntakePool,
        scheduling_pool: SchedulingPool,
        run_request: RequestRunner,
        shares: ModelShares | None = None,
    ) -> None:
        self.shares = shares
        self.intake_pool = intake_pool
        self.scheduling_pool = scheduling_pool
        self._run_request = run_request
        self.pacer = Pacer()
        self._wakeup = anyio.Event()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._paused = False

    @property
    def paused(self) -> bool:
        """While True nothing new is admitted (the service pauses to drain before shutdown)."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = value
        if not value:
            self.notify()  # slots freed while paused are refilled now

    def admit(self, limit: int | None = None) -> list[IntakeEntry]:
        """Take queued requests into free slots (at most ``limit``), in the intake pool's fair order."""
        admitted: list[IntakeEntry] = []
        while not self._paused and self.scheduling_pool.free and self.intake_pool.size:
            if limit is not None and len(admitted) >= limit:
                break
            entry = self._pop()
            if entry is None:
                break
            admitted.append(entry)
        return admitted

    def _pop(self) -> IntakeEntry | None:
        """The next queued request, its slot taken; None when nothing may be admitted now."""
        admissible = None
        if self.shares is not None:
            admissible = self.shares.admission_test(self.intake_pool.queued_batches())
        entry = self.intake_pool.pop(admissible)
        if entry is None:
            assert admissible is not None  # without shares, a non-empty pool always gives one
            return None
        self.scheduling_pool.acquire(entry.batch_id)
        if self.shares is not None:
            self.shares.acquire(entry.batch_id)
        return entry

    def finish(self, entry: IntakeEntry) -> None:
        """Give back the slot a request held, and count the request as drained."""
        self.scheduling_pool.release(entry.batch_id)
        if self.shares is not None:
            self.shares.release(entry.batch_id)
        self.intake_pool.drain.record()

    def notify(self) -> None:
        """Tell the loop that work was queued."""
        self._wakeup.set()

    def _start_admitted(self) -> bool:
        """Start a task for each request admitted now (one turn's worth); True if more could start."""
        assert self._tasks is not None
        admitted = self.admit(ADMIT_PER_TURN)
        for entry in admitted:
            self._tasks.start_soon(self._run_one, entry)
        more = not self._paused and bool(self.scheduling_pool.free) and bool(self.intake_pool.size)
        return more and len(admitted) == ADMIT_PER_TURN

    def _admit_one(self) -> IntakeEntry | None:
        if self._paused or not self.scheduling_pool.free or not self.intake_pool.size:
            return None
        return self._pop()

    async def _run_one(self, entry: IntakeEntry) -> None:
        """Run a request; then keep this task for the next admitted one instead of starting a task."""
        current: IntakeEntry | None = entry
        while current is not None:
            try:
                await self.pacer.pace()  # let the loop serve other work between requests
                await self._run_request(current)
            except Exception:  # the runner reports its own failures; never lose the slot
                logger.exception("request %s:%d raised", current.batch_id, current.line)
            finally:
                self.finish(current)
            if self._tasks is None or self._tasks.cancel_scope.cancel_called:
                return
            current = self._admit_one()  # the freed slot is refilled at once, in fair order

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Admit and run requests until cancelled."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            tasks.start_soon(self.pacer.run)
            task_status.started()
            try:
                while True:
                    if self._start_admitted():
                        await anyio.lowlevel.checkpoint()  # the rest in later turns of the loop
                        continue
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
            finally:
                self._tasks = None

    async def wait_until_idle(self) -> None:
        """Return once nothing is queued and nothing is running (for tests and pipelines)."""
        while self.intake_pool.size or self.scheduling_pool.active:
            await anyio.sleep(0.005)
