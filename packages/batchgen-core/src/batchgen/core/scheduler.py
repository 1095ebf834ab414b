"""Scheduler: moves requests from the intake pool into free slots and runs them.

The decisions are synchronous and small (``admit`` fills free slots in the intake pool's fair
order; ``finish`` frees a slot) so they can be tested directly. ``run`` is the async loop that
starts one task per admitted request and always releases its slot, whatever the request did.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from batchgen.core.intake import IntakeEntry, IntakePool
from batchgen.core.scheduling import SchedulingPool

logger = logging.getLogger("batchgen.scheduler")

RequestRunner = Callable[[IntakeEntry], Awaitable[None]]


class Scheduler:
    def __init__(self, intake: IntakePool, slots: SchedulingPool, run_request: RequestRunner) -> None:
        self.intake = intake
        self.slots = slots
        self._run_request = run_request
        self._wakeup = anyio.Event()

    def admit(self) -> list[IntakeEntry]:
        """Take queued requests into free slots, in the intake pool's fair order."""
        admitted: list[IntakeEntry] = []
        while self.slots.free and self.intake.size:
            entry = self.intake.pop()
            assert entry is not None
            self.slots.acquire(entry.batch_id)
            admitted.append(entry)
        return admitted

    def finish(self, entry: IntakeEntry) -> None:
        """Give back the slot a request held."""
        self.slots.release(entry.batch_id)

    def notify(self) -> None:
        """Tell the loop that work was queued or a slot was freed."""
        self._wakeup.set()

    async def _run_one(self, entry: IntakeEntry) -> None:
        try:
            await self._run_request(entry)
        except Exception:  # the runner reports its own failures; never lose the slot
            logger.exception("request %s:%d raised", entry.batch_id, entry.line)
        finally:
            self.finish(entry)
            self.notify()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Admit and run requests until cancelled."""
        async with anyio.create_task_group() as tasks:
            task_status.started()
            while True:
                admitted = self.admit()
                for entry in admitted:
                    tasks.start_soon(self._run_one, entry)
                if admitted:
                    await anyio.lowlevel.checkpoint()
                else:
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()

    async def wait_until_idle(self) -> None:
        """Return once nothing is queued and nothing is running (for tests and pipelines)."""
        while self.intake.size or self.slots.active:
            await anyio.sleep(0.005)
