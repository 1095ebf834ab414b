"""The scheduler: moves requests from the intake pool into free slots of the scheduling pool and runs them.

The decisions are synchronous and small (``admit`` fills free slots in the intake pool's fair
order; ``finish`` frees a slot) so they can be tested directly. ``run`` is the async loop that
starts a task for each **group** of admitted requests (up to ``group_size``, taken together in
fair order) and hands the group to the runner in one call; the runner reports each request as it
ends, which frees its slot at once. A group's task always releases every slot of its group,
whatever the runner did, then refills the group from the intake pool in the same step and runs
that next group itself, so a busy scheduler creates no task per request, nor per group. A runner
of single requests (``run_request``) is run in groups of one.

The loop stays responsive under load: ``run`` admits at most ``ADMIT_PER_TURN`` requests per turn
of the event loop, and every group's task asks the ``Pacer`` for a turn before each group, so
thousands of requests that need no I/O cannot hold the loop for long. Each finished request is
counted on the intake pool's drain meter, as is each admission (the meter measures the rate over
the time the slots have been busy): the basis of ``Retry-After`` when the pool is full.

With several served models, ``shares`` (``ModelShares``) keeps any one model from holding more
than its fair share of the slots while another model has queued work; every admission, the
refill of a group's freed slots included, goes through ``admit`` and so through that check.

Admission stops while the scheduler is ``paused`` (a shutdown) or a ``hold`` is on (result lines
waiting for a full disk: ``execution.held_results``); requests already running go on to their end.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from batchgen.core.scheduling.intake_pool import IntakeEntry, IntakePool
from batchgen.core.scheduling.model_shares import ModelShares
from batchgen.core.scheduling.pacer import Pacer
from batchgen.core.scheduling.scheduling_pool import SchedulingPool

logger = logging.getLogger("batchgen.scheduler")

RequestRunner = Callable[[IntakeEntry], Awaitable[None]]


class Finished(Protocol):
    """``finished(*positions)``: the requests ``entries[position]`` of a group have ended."""

    def __call__(self, *positions: int) -> None: ...


#: ``run_group(entries, finished)`` runs the requests ``entries`` point at and calls ``finished``
#: the moment some of them have ended (each position at most once); their slots are refilled then.
GroupRunner = Callable[[Sequence[IntakeEntry], Finished], Awaitable[None]]

#: The most requests ``run`` admits in one turn of the event loop.
ADMIT_PER_TURN = 256
#: The most requests handed to a group runner in one call.
GROUP_SIZE = 128


class _Group:
    """Admitted requests run together; each frees its slot when it is reported finished."""

    __slots__ = ("done", "entries", "running", "scheduler")

    def __init__(self, scheduler: Scheduler, entries: list[IntakeEntry]) -> None:
        self.scheduler = scheduler
        self.entries = entries
        self.done = [False] * len(entries)
        self.running = True

    def finished(self, *positions: int) -> None:
        freed = 0
        for position in positions:
            if not self.done[position]:
                self.done[position] = True
                self.scheduler.finish(self.entries[position])
                freed += 1
        if freed and self.running:  # the rest of the group runs on: refill the freed slots now
            self.scheduler._refill(freed)

    def finish_rest(self) -> None:
        self.running = False
        self.finished(*range(len(self.entries)))


def _in_groups_of_one(run_request: RequestRunner) -> GroupRunner:
    async def run_group(entries: Sequence[IntakeEntry], finished: Finished) -> None:
        for entry in entries:  # one: its slot is freed, and refilled, once it returns
            await run_request(entry)

    return run_group


#: How long a refill group waits for more freed slots to join it before it runs (``_run_refills``).
REFILL_GATHER_S = 0.005


class Scheduler:
    """Admits queued requests into free slots and runs each on ``run_request``."""

    def __init__(
        self,
        intake_pool: IntakePool,
        scheduling_pool: SchedulingPool,
        run_request: RequestRunner | None = None,
        shares: ModelShares | None = None,
        *,
        run_group: GroupRunner | None = None,
        group_size: int = GROUP_SIZE,
    ) -> None:
        """Give ``run_request`` (requests one at a time) or ``run_group`` (up to ``group_size``
        requests per call)."""
        if run_group is None:
            if run_request is None:
                raise TypeError("a Scheduler needs run_request or run_group")
            run_group, group_size = _in_groups_of_one(run_request), 1
        if group_size < 1:
            raise ValueError("group_size must be at least 1")
        self.shares = shares
        self.intake_pool = intake_pool
        self.scheduling_pool = scheduling_pool
        self._run_group = run_group
        self.group_size = group_size
        self.pacer = Pacer()
        self._refills: list[IntakeEntry] = []
        self._refills_full = anyio.Event()
        self._wakeup = anyio.Event()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._paused = False
        #: Why admission is held besides ``paused`` (``hold``): a storage that refuses result lines.
        self._holds: set[str] = set()

    @property
    def paused(self) -> bool:
        """While True nothing new is admitted (the service pauses to drain before shutdown)."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = value
        if not value:
            self.notify()  # slots freed while paused are refilled now

    def hold(self, reason: str) -> None:
        """Admit nothing new until ``release(reason)`` (requests running go on to their end)."""
        self._holds.add(reason)

    def release(self, reason: str) -> None:
        """Lift the hold ``hold(reason)`` put on admission; slots freed meanwhile are refilled."""
        if reason in self._holds:
            self._holds.discard(reason)
            self.notify()

    @property
    def admitting(self) -> bool:
        """Whether new requests may be admitted now: not paused, and no hold on."""
        return not self._paused and not self._holds

    def admit(self, limit: int | None = None) -> list[IntakeEntry]:
        """Take queued requests into free slots (at most ``limit``), in the intake pool's fair order."""
        admitted: list[IntakeEntry] = []
        while self.admitting and self.scheduling_pool.free and self.intake_pool.size:
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
        self.intake_pool.drain.admitted()
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
        """Start a task for each group admitted now (one turn's worth); True if more could start."""
        assert self._tasks is not None
        admitted = 0
        while admitted < ADMIT_PER_TURN:
            started = self._start_group(min(self.group_size, ADMIT_PER_TURN - admitted))
            if not started:
                break
            admitted += started
        more = self.admitting and bool(self.scheduling_pool.free) and bool(self.intake_pool.size)
        return more and admitted >= ADMIT_PER_TURN  # fewer: nothing more may be admitted now

    def _refill(self, size: int) -> None:
        """Admit up to ``size`` requests now, into the refill group that gathers the slots freed
        meanwhile; one task runs it (``_run_refills``)."""
        if self._tasks is None or self._tasks.cancel_scope.cancel_called:
            return
        entries = self.admit(size)
        if not entries:
            return
        if not self._refills:
            self._refills_full = anyio.Event()
            self._tasks.start_soon(self._run_refills, name="batchgen refill")
        self._refills.extend(entries)
        if len(self._refills) >= self.group_size:
            self._refills_full.set()

    async def _run_refills(self) -> None:
        """Run the refill group: once it is full, or ``REFILL_GATHER_S`` after its first slot was
        refilled, whichever comes first. Slots freed one or two at a time (requests of spread-out
        lengths) then make a few larger groups rather than many of one or two, whose fixed costs
        (a task, reading their lines, a backend call) would keep the event loop busy and the slots
        waiting longer than the gathering does."""
        if len(self._refills) < self.group_size:
            with anyio.move_on_after(REFILL_GATHER_S):
                await self._refills_full.wait()
        refills, self._refills = self._refills, []
        assert self._tasks is not None
        for start in range(self.group_size, len(refills), self.group_size):
            self._tasks.start_soon(self._run_groups, refills[start : start + self.group_size])
        await self._run_groups(refills[: self.group_size])

    def _start_group(self, size: int) -> int:
        """Admit up to ``size`` requests and start a task for them; how many were admitted."""
        if self._tasks is None or self._tasks.cancel_scope.cancel_called:
            return 0
        entries = self.admit(size)
        if entries:
            self._tasks.start_soon(self._run_groups, entries)
        return len(entries)

    async def _run_groups(self, entries: list[IntakeEntry]) -> None:
        """Run a group; then keep this task for the next admitted group instead of starting a task."""
        started = True
        while entries:
            group = _Group(self, entries)
            try:
                if not (started and self.pacer.open()):  # a new task has just had the loop yield
                    await self.pacer.pace(len(entries))  # let the loop serve other work between groups
                started = False
                await self._run_group(entries, group.finished)
            except Exception:  # the runner reports its own failures; never lose a slot
                logger.exception("requests %s:%d.. raised", entries[0].batch_id, entries[0].line)
            finally:
                group.finish_rest()
            if self._tasks is None or self._tasks.cancel_scope.cancel_called:
                return
            entries = self.admit(self.group_size)  # freed slots are refilled at once, in fair order

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
