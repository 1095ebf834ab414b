"""The scheduler: moves requests from the intake pool into free slots of the scheduling pool and runs them.

The decisions are synchronous and small (``admit`` fills free slots in the intake pool's fair
order; ``finish`` frees a slot) so they can be tested directly. ``run`` is the async loop that
starts a task for each admitted request; a request's task always releases its slot, whatever the
request did, refills it from the intake pool in the same step, and runs that next request itself,
so a busy scheduler creates no task per request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from batchgen.core.scheduling.intake_pool import IntakeEntry, IntakePool
from batchgen.core.scheduling.scheduling_pool import SchedulingPool

logger = logging.getLogger("batchgen.scheduler")

RequestRunner = Callable[[IntakeEntry], Awaitable[None]]


class Scheduler:
    """Admits queued requests into free slots and runs each on ``run_request``."""

    def __init__(
        self, intake_pool: IntakePool, scheduling_pool: SchedulingPool, run_request: RequestRunner
    ) -> None:
        self.intake_pool = intake_pool
        self.scheduling_pool = scheduling_pool
        self._run_request = run_request
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

    def admit(self) -> list[IntakeEntry]:
        """Take queued requests into free slots, in the intake pool's fair order."""
        admitted: list[IntakeEntry] = []
        while not self._paused and self.scheduling_pool.free and self.intake_pool.size:
            entry = self.intake_pool.pop()
            assert entry is not None
            self.scheduling_pool.acquire(entry.batch_id)
            admitted.append(entry)
        return admitted

    def finish(self, entry: IntakeEntry) -> None:
        """Give back the slot a request held."""
        self.scheduling_pool.release(entry.batch_id)

    def notify(self) -> None:
        """Tell the loop that work was queued."""
        self._wakeup.set()

    def _start_admitted(self) -> None:
        assert self._tasks is not None
        for entry in self.admit():
            self._tasks.start_soon(self._run_one, entry)

    def _admit_one(self) -> IntakeEntry | None:
        if self._paused or not self.scheduling_pool.free or not self.intake_pool.size:
            return None
        entry = self.intake_pool.pop()
        assert entry is not None
        self.scheduling_pool.acquire(entry.batch_id)
        return entry

    async def _run_one(self, entry: IntakeEntry) -> None:
        """Run a request; then keep this task for the next admitted one instead of starting a task."""
        current: IntakeEntry | None = entry
        while current is not None:
            try:
                await self._run_request(current)
            except Exception:  # the runner reports its own failures; never lose the slot
                logger.exception("request %s:%d raised", current.batch_id, current.line)
            finally:
                self.finish(current)
            if self._tasks is None or self._tasks.cancel_scope.cancel_called:
                return
            current = self._admit_one()  # the freed slot is refilled at once, in fair order
            if current is not None:
                await anyio.lowlevel.checkpoint()  # let other work run between requests

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Admit and run requests until cancelled."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            try:
                while True:
                    self._start_admitted()
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
            finally:
                self._tasks = None

    async def wait_until_idle(self) -> None:
        """Return once nothing is queued and nothing is running (for tests and pipelines)."""
        while self.intake_pool.size or self.scheduling_pool.active:
            await anyio.sleep(0.005)
