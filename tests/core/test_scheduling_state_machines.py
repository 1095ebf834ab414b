"""Stateful tests of the intake pool, the scheduling pool and the scheduler's decisions.

``SchedulerMachine`` drives the real ``IntakePool``, ``SchedulingPool`` and ``Scheduler`` with
random batches (some given as an explicit subset of lines, as after a restart), admissions,
finishes and cancels, and checks them against a plain model of which (batch, line) requests are
queued, running, finished or dropped. It states the invariants of docs/architecture.md that these
classes own:

1. Conservation: every request of an accepted batch ends exactly once, admitted (then finished)
   or dropped by a cancel; none is duplicated or lost.
2. Capacity: the intake never holds more than its capacity, and a rejected batch changes nothing;
   running requests never exceed the slots; finishing a request frees its slot; ``admit`` fills
   every free slot it can, and none while the scheduler is paused.
3. Fairness: if batch A is admitted at one step and again at a later step, every other batch that
   had queued work at the first admission, and was not cancelled since, was admitted in between.
4. Cancellation: once a batch is cancelled, none of its queued requests is admitted.
5. Offsets: an admitted entry carries the offset and length of its line in that batch's LineIndex.
6. Reservations: reserved + queued never exceed the capacity and ``free`` counts both; a
   reservation that does not fit is refused whole; each reservation is either converted exactly
   (``add`` queues the batch in its places, the rest given back) or released, never both.

``test_run_loop_runs_each_entry_once_and_releases_every_slot`` runs the real async ``run`` loop
with a runner that succeeds, raises or sleeps at random, while batches arrive (waiting out
IntakeFull), one is cancelled and admissions are paused once, and checks that each request ran
exactly once and every slot came back.
"""

from __future__ import annotations

import math
import random
import tracemalloc
from array import array
from collections import Counter

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchgen.core.errors import IntakeFull
from batchgen.core.files.batch_file import LineIndex
from batchgen.core.scheduling import IntakeEntry, IntakePool, Scheduler, SchedulingPool
from tests.examples import examples

Request = tuple[str, int]  # (batch_id, line)


def make_index(base: int, lengths: list[int]) -> LineIndex:
    """A LineIndex of consecutive lines starting at byte ``base``, one newline between lines."""
    offsets = array("q")
    position = base
    for length in lengths:
        offsets.append(position)
        position += length + 1
    return LineIndex(offsets=offsets, lengths=array("l", lengths))


async def _not_run(entry: IntakeEntry) -> None:
    raise AssertionError("the state machine never starts the run loop")


class SchedulerMachine(RuleBasedStateMachine):
    """The real pools and scheduler decisions, checked against a model of every request."""

    @initialize(intake_capacity=st.integers(1, 60), slot_count=st.integers(1, 8))
    def setup(self, intake_capacity: int, slot_count: int) -> None:
        self.intake_pool = IntakePool(intake_capacity)
        self.scheduling_pool = SchedulingPool(slot_count)
        self.scheduler = Scheduler(self.intake_pool, self.scheduling_pool, _not_run)
        self.batch_count = 0
        self.indexes: dict[str, LineIndex] = {}
        # The model: each added request is in exactly one of queued, running, finished, dropped.
        self.added: set[Request] = set()
        self.queued: dict[str, set[int]] = {}  # only batches with queued work
        self.running: list[IntakeEntry] = []
        self.finished: set[Request] = set()
        self.dropped: set[Request] = set()
        self.admitted: set[Request] = set()
        self.cancelled: set[str] = set()
        # owed[a]: batches that had queued work when ``a`` was last admitted and have been neither
        # admitted nor cancelled since. It must be empty when ``a`` is admitted again.
        self.owed: dict[str, set[str]] = {}
        self.reservations: dict[str, int] = {}  # held now
        self.converted: set[str] = set()
        self.released: set[str] = set()

    # -- rules ---------------------------------------------------------------------------------

    @rule(data=st.data(), size=st.integers(0, 50))
    def add_batch(self, data: st.DataObject, size: int) -> None:
        """Add a new batch: all its lines, or an explicit subset (as when resuming after a restart)."""
        batch_id = f"batch_{self.batch_count}"
        self.batch_count += 1
        # Irregular line lengths, so a wrong line or a wrong batch's index gives a wrong offset.
        rng = random.Random(self.batch_count)
        index = make_index(self.batch_count * 1_000_000, [rng.randint(1, 5_000) for _ in range(size)])
        lines: list[int] | None = None
        if size and data.draw(st.booleans(), label="explicit lines"):
            lines = data.draw(st.lists(st.integers(0, size - 1), unique=True), label="lines")
        wanted = list(range(size)) if lines is None else lines
        fits = len(wanted) <= self.intake_pool.capacity - self.intake_pool.size - self.intake_pool.reserved
        before = self._intake_snapshot()

        try:
            # A one-shot iterator is a valid ``Iterable[int]`` too.
            queued = self.intake_pool.add(batch_id, index, None if lines is None else iter(lines))
        except IntakeFull:
            assert not fits, (
                f"{len(wanted)} requests fit in {self.intake_pool.free} free places but were refused"
            )
            assert self._intake_snapshot() == before, "a refused batch changed the intake pool"
            assert batch_id not in self.intake_pool
            return
        assert fits, f"{len(wanted)} requests were accepted with only {before[1]} free places"
        assert queued == len(wanted)

        self.indexes[batch_id] = index
        self.added.update((batch_id, line) for line in wanted)
        if wanted:
            self.queued[batch_id] = set(wanted)

    @rule(size=st.integers(0, 50))
    def reserve(self, size: int) -> None:
        """Accept a batch: hold its places before it is indexed."""
        batch_id = f"batch_{self.batch_count}"
        self.batch_count += 1
        fits = size <= self.intake_pool.free
        before = (self.intake_pool.size, self.intake_pool.reserved)
        try:
            self.intake_pool.reserve(batch_id, size)
        except IntakeFull as refused:
            assert not fits, f"{size} places fit in {self.intake_pool.free} free but were refused"
            assert 1 <= refused.retry_after_s <= 300
            assert (self.intake_pool.size, self.intake_pool.reserved) == before
            return
        assert fits, f"{size} places were reserved with only {before} taken"
        self.reservations[batch_id] = size
        self.indexes[batch_id] = make_index(self.batch_count * 1_000_000, [7] * size)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def convert(self, data: st.DataObject) -> None:
        """The batch is indexed: its reservation becomes queued requests (all, or a resumed subset)."""
        batch_id = data.draw(st.sampled_from(sorted(self.reservations)), label="converted batch")
        held = self.reservations[batch_id]
        free_before = self.intake_pool.free
        index = self.indexes[batch_id]
        lines = None
        if held and data.draw(st.booleans(), label="subset"):
            lines = data.draw(st.lists(st.integers(0, held - 1), unique=True), label="lines")
        wanted = list(range(held)) if lines is None else lines
        assert self.intake_pool.add(batch_id, index, lines) == len(wanted)
        del self.reservations[batch_id]
        self.converted.add(batch_id)
        assert self.intake_pool.reserved_for(batch_id) == 0
        assert self.intake_pool.free == free_before + held - len(wanted), "the rest was not given back"
        self.added.update((batch_id, line) for line in wanted)
        if wanted:
            self.queued[batch_id] = set(wanted)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), by_drop=st.booleans())
    def release(self, data: st.DataObject, by_drop: bool) -> None:
        """The batch failed or was cancelled before it was indexed: its places come back."""
        batch_id = data.draw(st.sampled_from(sorted(self.reservations)), label="released batch")
        held = self.reservations.pop(batch_id)
        free_before = self.intake_pool.free
        if by_drop:
            assert self.intake_pool.drop(batch_id) == 0  # nothing was queued yet
        else:
            assert self.intake_pool.release(batch_id) == held
        assert self.intake_pool.free == free_before + held
        assert self.intake_pool.release(batch_id) == 0, "a reservation was released twice"
        self.released.add(batch_id)
        self.cancelled.add(batch_id)

    @rule()
    def admit(self) -> None:
        self._admit()

    @rule(paused=st.booleans())
    def pause(self, paused: bool) -> None:
        """Pause or resume admissions (the service pauses to drain before shutting down)."""
        self.scheduler.paused = paused

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.running), label="finished entry")
        self._finish(entry)

    @precondition(lambda self: self.indexes)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """Cancel a batch (queued, drained, already cancelled, or one the pool never saw)."""
        batch_id = data.draw(st.sampled_from([*sorted(self.indexes), "never_added"]), label="cancelled batch")
        running_before = self.scheduling_pool.active_for(batch_id)
        remaining = self.queued.pop(batch_id, set())
        held = self.reservations.pop(batch_id, None)  # cancelled before it was indexed
        free_before = self.intake_pool.free

        assert self.intake_pool.drop(batch_id) == len(remaining)
        assert self.intake_pool.free == free_before + len(remaining) + (held or 0)
        if held is not None:
            self.released.add(batch_id)

        assert self.intake_pool.queued(batch_id) == 0
        assert batch_id not in self.intake_pool
        assert self.scheduling_pool.active_for(batch_id) == running_before, (
            "cancel must not touch running requests"
        )
        self.dropped.update((batch_id, line) for line in remaining)
        self.cancelled.add(batch_id)
        self.owed.pop(batch_id, None)
        for waiting in self.owed.values():
            waiting.discard(batch_id)

    @precondition(lambda self: self.intake_pool.size == 0)
    @rule()
    def pop_from_empty_intake(self) -> None:
        assert self.intake_pool.pop() is None

    @rule()
    def release_unheld_slot_is_refused(self) -> None:
        """Releasing a slot the batch does not hold raises and changes nothing."""
        active = self.scheduling_pool.active
        stray = IntakeEntry("never_added", 0, 0, 1)
        try:
            self.scheduler.finish(stray)
        except RuntimeError:
            pass
        else:
            raise AssertionError("a slot that was never acquired was released")
        assert self.scheduling_pool.active == active

    @precondition(lambda self: self.scheduling_pool.free == 0)
    @rule()
    def acquire_beyond_capacity_is_refused(self) -> None:
        """With every slot taken, another acquire raises and changes nothing."""
        try:
            self.scheduling_pool.acquire("never_added")
        except RuntimeError:
            pass
        else:
            raise AssertionError("a slot was acquired beyond the capacity")
        assert self.scheduling_pool.active == self.scheduling_pool.capacity

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def intake_matches_model_and_capacity(self) -> None:
        assert 0 <= self.intake_pool.size + self.intake_pool.reserved <= self.intake_pool.capacity
        assert self.intake_pool.reserved == sum(self.reservations.values())
        assert (
            self.intake_pool.free
            == self.intake_pool.capacity - self.intake_pool.size - self.intake_pool.reserved
        )
        for batch_id, held in self.reservations.items():
            assert self.intake_pool.reserved_for(batch_id) == held
        assert not self.converted & self.released, "a reservation was both converted and released"
        assert self.intake_pool.size == sum(len(lines) for lines in self.queued.values())
        for batch_id in self.indexes:
            assert self.intake_pool.queued(batch_id) == len(self.queued.get(batch_id, ()))
            assert (batch_id in self.intake_pool) == (batch_id in self.queued)

    @invariant()
    def slots_match_model_and_capacity(self) -> None:
        assert 0 <= self.scheduling_pool.active <= self.scheduling_pool.capacity
        assert self.scheduling_pool.active == len(self.running)
        assert self.scheduling_pool.free == self.scheduling_pool.capacity - self.scheduling_pool.active
        per_batch = Counter(entry.batch_id for entry in self.running)
        for batch_id in [*self.indexes, "never_added"]:
            assert self.scheduling_pool.active_for(batch_id) == per_batch[batch_id]

    @invariant()
    def every_request_is_in_exactly_one_state(self) -> None:
        queued = {(batch_id, line) for batch_id, lines in self.queued.items() for line in lines}
        running = {(entry.batch_id, entry.line) for entry in self.running}
        parts = [queued, running, self.finished, self.dropped]
        assert sum(len(part) for part in parts) == len(self.added), "a request is in two states"
        assert set().union(*parts) == self.added, "a request was lost or invented"
        assert len(running) == len(self.running), "a request runs twice"
        assert running | self.finished == self.admitted

    def teardown(self) -> None:
        """Drain what is left: every accepted request then ended exactly once, every slot is free."""
        if not hasattr(self, "intake_pool"):
            return
        self.scheduler.paused = False
        for _ in range(len(self.added) + 1):  # each round admits at least one new request
            for entry in list(self.running):
                self._finish(entry)
            if not self.intake_pool.size:
                break
            assert self.scheduling_pool.free == self.scheduling_pool.capacity
            self._admit()
        else:
            raise AssertionError("the intake pool did not drain")
        assert self.finished | self.dropped == self.added
        assert not self.finished & self.dropped
        assert self.scheduling_pool.active == 0 and self.scheduling_pool.free == self.scheduling_pool.capacity
        assert self.intake_pool.size == 0 and self.intake_pool.pop() is None
        for batch_id in list(self.reservations):  # what is still held comes back in full
            assert self.intake_pool.release(batch_id) == self.reservations.pop(batch_id)
        assert self.intake_pool.reserved == 0 and self.intake_pool.free == self.intake_pool.capacity

    # -- shared steps --------------------------------------------------------------------------

    def _intake_snapshot(self) -> tuple[int, int, dict[str, int]]:
        return (
            self.intake_pool.size,
            self.intake_pool.free,
            {batch_id: self.intake_pool.queued(batch_id) for batch_id in self.indexes},
        )

    def _admit(self) -> None:
        expected = 0 if self.scheduler.paused else min(self.scheduling_pool.free, self.intake_pool.size)
        admitted = self.scheduler.admit()
        assert len(admitted) == expected, f"admitted {len(admitted)}, but {expected} could start"
        for entry in admitted:  # in the order the intake pool handed them out
            self._check_admission(entry)

    def _check_admission(self, entry: IntakeEntry) -> None:
        batch_id, line = entry.batch_id, entry.line
        assert batch_id not in self.cancelled, f"{batch_id} was cancelled but line {line} was admitted"
        assert (batch_id, line) not in self.admitted, f"{batch_id} line {line} was admitted twice"
        assert line in self.queued.get(batch_id, ()), f"{batch_id} line {line} was admitted but not queued"

        index = self.indexes[batch_id]
        assert (entry.offset, entry.length) == (index.offsets[line], index.lengths[line])

        skipped = self.owed.get(batch_id, set())
        assert not skipped, f"{batch_id} was admitted twice while {sorted(skipped)} waited with queued work"
        for waiting in self.owed.values():
            waiting.discard(batch_id)
        self.owed[batch_id] = {other for other in self.queued if other != batch_id}

        self.queued[batch_id].discard(line)
        if not self.queued[batch_id]:
            del self.queued[batch_id]
            del self.owed[batch_id]  # no queued work left, so no further admission to check
        self.admitted.add((batch_id, line))
        self.running.append(entry)

    def _finish(self, entry: IntakeEntry) -> None:
        free, held = self.scheduling_pool.free, self.scheduling_pool.active_for(entry.batch_id)
        self.scheduler.finish(entry)
        assert self.scheduling_pool.free == free + 1, "finishing a request did not free its slot"
        assert self.scheduling_pool.active_for(entry.batch_id) == held - 1
        self.running.remove(entry)
        self.finished.add((entry.batch_id, entry.line))


SchedulerMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=60, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase


# -- the async run loop ------------------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(4))
async def test_run_loop_runs_each_entry_once_and_releases_every_slot(seed: int) -> None:
    """A few hundred requests through the real loop: each runs once, whatever it does, and no slot leaks."""
    rng = random.Random(seed)
    intake = IntakePool(40)
    slots = SchedulingPool(5)
    indexes: dict[str, LineIndex] = {}
    started: Counter[Request] = Counter()
    wrong_offsets: list[IntakeEntry] = []
    outcomes: Counter[str] = Counter()
    in_flight = 0
    peak = 0

    async def run_request(entry: IntakeEntry) -> None:
        # The scheduler swallows exceptions from the runner, so record problems and check later.
        nonlocal in_flight, peak
        started[(entry.batch_id, entry.line)] += 1
        index = indexes[entry.batch_id]
        if (entry.offset, entry.length) != (index.offsets[entry.line], index.lengths[entry.line]):
            wrong_offsets.append(entry)
        in_flight += 1
        peak = max(peak, in_flight, slots.active)
        try:
            roll = rng.random()
            if roll < 0.25:
                outcomes["raised at once"] += 1
                raise RuntimeError("the backend failed")
            await anyio.sleep(rng.uniform(0, 0.002))
            if roll < 0.45:
                outcomes["raised after sleeping"] += 1
                raise ValueError("the backend failed late")
            outcomes["succeeded"] += 1
        finally:
            in_flight -= 1

    scheduler = Scheduler(intake, slots, run_request)

    async def check_pause_drains_and_admits_nothing() -> None:
        scheduler.paused = True
        with anyio.fail_after(5):
            while slots.active:
                await anyio.sleep(0.001)
        runs, queued = started.total(), intake.size
        assert queued, "the batch added just before the pause should still be queued"
        scheduler.notify()
        await anyio.sleep(0.01)
        assert (started.total(), intake.size, slots.active) == (runs, queued, 0), "admitted while paused"
        scheduler.paused = False
        scheduler.notify()

    expected: set[Request] = set()
    cancelled = "batch_5"
    dropped = 0
    async with anyio.create_task_group() as tasks:
        await tasks.start(scheduler.run)
        for number in range(25):
            batch_id = f"batch_{number}"
            size = rng.randint(1, 25)
            indexes[batch_id] = make_index(number * 1_000_000, [rng.randint(1, 500) for _ in range(size)])
            with anyio.fail_after(10):
                while True:
                    try:
                        intake.add(batch_id, indexes[batch_id])
                        break
                    except IntakeFull:
                        await anyio.sleep(0.001)  # wait for running requests to make room
            scheduler.notify()
            expected.update((batch_id, line) for line in range(size))
            if number == 8:  # cancel an earlier batch, which may be queued, running or done
                dropped = intake.drop(cancelled)
            if number == 15:  # pause as the service does before shutdown, then resume
                await check_pause_drains_and_admits_nothing()
            await anyio.sleep(rng.uniform(0, 0.002))
        with anyio.fail_after(10):
            await scheduler.wait_until_idle()
        tasks.cancel_scope.cancel()

    assert slots.active == 0 and slots.free == slots.capacity
    assert intake.size == 0
    assert all(count == 1 for count in started.values()), [r for r, n in started.items() if n > 1]
    assert set(started) <= expected
    assert sum(1 for batch_id, _ in started if batch_id == cancelled) == len(indexes[cancelled]) - dropped
    assert {r for r in expected if r[0] != cancelled} <= set(started), "a request never ran"
    assert not wrong_offsets
    assert 1 < peak <= slots.capacity
    assert outcomes["raised at once"] and outcomes["raised after sleeping"] and outcomes["succeeded"]


@pytest.mark.parametrize("lines", [[5, 1], [-1], [1, 1]], ids=["out-of-range", "negative", "repeated"])
def test_intake_refuses_line_positions_outside_the_index_or_repeated(lines: list[int]) -> None:
    pool = IntakePool(capacity=10)
    with pytest.raises(ValueError):
        pool.add("batch", make_index(0, [3, 4, 5]), lines)
    assert (pool.size, "batch" in pool) == (0, False)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_resuming_refills_slots_freed_while_paused() -> None:
    intake, slots = IntakePool(capacity=10), SchedulingPool(capacity=1)
    ran: list[int] = []
    gate = anyio.Event()

    async def runner(entry: IntakeEntry) -> None:
        ran.append(entry.line)
        if entry.line == 0:
            await gate.wait()

    scheduler = Scheduler(intake, slots, runner)
    async with anyio.create_task_group() as tasks:
        await tasks.start(scheduler.run)
        intake.add("b", make_index(0, [1, 1, 1]))
        scheduler.notify()
        while not ran:
            await anyio.sleep(0.001)
        scheduler.paused = True
        gate.set()
        await anyio.sleep(0.05)
        assert (ran, intake.size, slots.active) == ([0], 2, 0)
        scheduler.paused = False  # no notify(): resuming alone must restart admission
        with anyio.fail_after(5):
            await scheduler.wait_until_idle()
        tasks.cancel_scope.cancel()
    assert ran == [0, 1, 2]


# -- tenants -----------------------------------------------------------------------------------

TENANTS = ("alpha", "beta", "gamma")


class TenantSchedulerMachine(RuleBasedStateMachine):
    """The real pools and scheduler with several tenants of random weights.

    Invariants, on top of those of ``SchedulerMachine``:

    - Capacity: running requests never exceed the slots; ``queued_for_tenant`` is each tenant's
      queued requests plus its reserved places, and ``free`` counts them all.
    - No tenant with queued work is starved: from the moment a tenant has queued work, the other
      tenants are admitted at most ``bound(tenant)`` requests before it is admitted, a bound set
      by the weights alone, however much the others have queued (a tenant with a million queued
      requests cannot make another wait for them).
    - Within a tenant, batches take turns: if a tenant's batch is admitted twice, each other batch
      of that tenant that had queued work at the first admission was admitted in between.
    """

    @initialize(
        slot_count=st.integers(1, 6),
        weights=st.tuples(*[st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])] * len(TENANTS)),
    )
    def setup(self, slot_count: int, weights: tuple[float, ...]) -> None:
        self.intake_pool = IntakePool(400)
        self.scheduling_pool = SchedulingPool(slot_count)
        self.scheduler = Scheduler(self.intake_pool, self.scheduling_pool, _not_run)
        self.weights = dict(zip(TENANTS, weights, strict=True))
        for tenant, weight in self.weights.items():
            self.intake_pool.set_weight(tenant, weight)
        self.batch_count = 0
        self.tenant_of: dict[str, str] = {}
        self.queued: dict[str, set[int]] = {}
        self.reservations: dict[str, int] = {}
        self.running: list[IntakeEntry] = []
        # waited[t]: admissions of other tenants since t last got one (or since it had work)
        self.waited: dict[str, int] = {}
        self.owed: dict[str, set[str]] = {}  # batch -> same-tenant batches owed a turn

    def bound(self, tenant: str) -> int:
        """Most admissions other tenants may get while ``tenant`` waits with queued work."""
        rounds = math.ceil(1 / min(self.weights[tenant], 1.0)) + 1
        return rounds * sum(math.ceil(self.weights[other]) + 1 for other in TENANTS if other != tenant)

    def _queued_tenants(self) -> set[str]:
        return {self.tenant_of[batch_id] for batch_id in self.queued}

    @rule(tenant=st.sampled_from(TENANTS), size=st.integers(1, 60), reserve_first=st.booleans())
    def add_batch(self, tenant: str, size: int, reserve_first: bool) -> None:
        batch_id = f"batch_{self.batch_count}"
        self.batch_count += 1
        index = make_index(self.batch_count * 1_000_000, [3] * size)
        if size > self.intake_pool.free:
            return
        if reserve_first:  # accepted now, queued later: the reservation carries the tenant
            self.intake_pool.reserve(batch_id, size, tenant)
            self.reservations[batch_id] = size
            self.tenant_of[batch_id] = tenant
            return
        self._queue(batch_id, tenant, index, explicit_tenant=True)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def convert(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted(self.reservations)))
        size = self.reservations.pop(batch_id)
        self._queue(batch_id, self.tenant_of[batch_id], make_index(0, [3] * size), explicit_tenant=False)

    def _queue(self, batch_id: str, tenant: str, index: LineIndex, *, explicit_tenant: bool) -> None:
        had_work = tenant in self._queued_tenants()
        self.intake_pool.add(batch_id, index, tenant=tenant if explicit_tenant else None)
        self.tenant_of[batch_id] = tenant
        self.queued[batch_id] = set(range(len(index)))
        if not had_work:
            self.waited[tenant] = 0

    @precondition(lambda self: self.queued or self.reservations)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted({*self.queued, *self.reservations})))
        tenant = self.tenant_of[batch_id]
        self.intake_pool.drop(batch_id)
        self.queued.pop(batch_id, None)
        self.reservations.pop(batch_id, None)
        self.owed.pop(batch_id, None)
        for waiting in self.owed.values():
            waiting.discard(batch_id)
        if tenant not in self._queued_tenants():
            self.waited.pop(tenant, None)

    @rule(tenant=st.sampled_from(TENANTS), weight=st.sampled_from([0.5, 1.0, 2.0]))
    def reweigh(self, tenant: str, weight: float) -> None:
        """A tenant's weight changes (``keys set-limits``): the bound follows the new weights."""
        self.intake_pool.set_weight(tenant, weight)
        self.weights[tenant] = weight
        self.waited = dict.fromkeys(self.waited, 0)  # a fresh start for the bound

    @rule()
    def admit(self) -> None:
        expected = min(self.scheduling_pool.free, self.intake_pool.size)
        admitted = self.scheduler.admit()
        assert len(admitted) == expected
        for entry in admitted:
            self._check_admission(entry)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.running))
        self.scheduler.finish(entry)
        self.running.remove(entry)

    def _check_admission(self, entry: IntakeEntry) -> None:
        batch_id, tenant = entry.batch_id, self.tenant_of[entry.batch_id]
        assert entry.line in self.queued.get(batch_id, ()), f"{batch_id}:{entry.line} was not queued"
        for other, waited in self.waited.items():
            if other != tenant:
                self.waited[other] = waited + 1
                assert self.waited[other] <= self.bound(other), (
                    f"tenant {other} (weight {self.weights[other]}) waited {self.waited[other]} admissions "
                    f"with queued work; weights {self.weights}"
                )
        self.waited[tenant] = 0
        skipped = self.owed.get(batch_id, set())
        assert not skipped, f"{batch_id} was admitted twice while {sorted(skipped)} of its tenant waited"
        for waiting in self.owed.values():
            waiting.discard(batch_id)
        self.owed[batch_id] = {b for b in self.queued if b != batch_id and self.tenant_of[b] == tenant}
        self.queued[batch_id].discard(entry.line)
        if not self.queued[batch_id]:
            del self.queued[batch_id]
            del self.owed[batch_id]
            if tenant not in self._queued_tenants():
                del self.waited[tenant]
        self.running.append(entry)

    @invariant()
    def slots_and_tenant_counts(self) -> None:
        if not hasattr(self, "intake_pool"):
            return
        assert 0 <= self.scheduling_pool.active == len(self.running) <= self.scheduling_pool.capacity
        for tenant in TENANTS:
            queued = sum(len(lines) for b, lines in self.queued.items() if self.tenant_of[b] == tenant)
            held = sum(size for b, size in self.reservations.items() if self.tenant_of[b] == tenant)
            assert self.intake_pool.queued_for_tenant(tenant) == queued + held
        assert self.intake_pool.free == self.intake_pool.capacity - sum(
            self.intake_pool.queued_for_tenant(tenant) for tenant in TENANTS
        )


TenantSchedulerMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=60, deadline=None
)
TestTenantSchedulerMachine = TenantSchedulerMachine.TestCase


def test_a_small_tenant_gets_slots_within_one_turnover_of_a_million_queued_requests() -> None:
    """Tenant A holds 1,000,000 queued requests, all slots run A's work; tenant B submits 100.
    As A's running requests finish, B's requests take the freed slots in turn with A's: B is
    admitted within the first slots freed, not after A drains."""
    intake, slots = IntakePool(2_000_000), SchedulingPool(8)
    scheduler = Scheduler(intake, slots, _not_run)
    intake.add("batch_a", make_index(0, [10] * 1_000_000), tenant="A")
    running = scheduler.admit()
    assert {entry.batch_id for entry in running} == {"batch_a"} and slots.free == 0
    intake.add("batch_b", make_index(0, [10] * 100), tenant="B")
    admitted: list[IntakeEntry] = []
    for _ in range(2):  # two slots free up
        scheduler.finish(running.pop(0))
        admitted += scheduler.admit()
    assert "batch_b" in {entry.batch_id for entry in admitted}, admitted
    running += admitted
    # B keeps half the slot turnover while both have work: it drains in about 200 admissions
    for _ in range(210):
        scheduler.finish(running.pop(0))
        running += scheduler.admit()
    assert intake.queued("batch_b") == 0 and intake.queued("batch_a") > 999_000


def test_weights_share_admissions_in_proportion() -> None:
    """Two tenants with weights 3 and 1 and plenty of queued work: 3 of 4 admissions go to the first."""
    intake, slots = IntakePool(10_000), SchedulingPool(400)
    intake.set_weight("heavy", 3)
    intake.add("h1", make_index(0, [1] * 1000), tenant="heavy")
    intake.add("h2", make_index(0, [1] * 1000), tenant="heavy")
    intake.add("l1", make_index(0, [1] * 1000), tenant="light")
    taken = Counter(entry.batch_id for entry in Scheduler(intake, slots, _not_run).admit())
    assert taken["h1"] + taken["h2"] == 300 and taken["l1"] == 100
    assert taken["h1"] == taken["h2"] == 150  # within a tenant, its batches take turns


def test_a_million_queued_requests_stay_small_in_memory() -> None:
    """1,000,000 queued requests (with their line index) take well under 64 MiB."""
    index = make_index(0, [100] * 1_000_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        intake = IntakePool(1_000_000)
        intake.add("huge", index, tenant="A")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    index_bytes = index.offsets.itemsize * len(index.offsets) + index.lengths.itemsize * len(index.lengths)
    assert intake.size == 1_000_000
    assert grown + index_bytes <= 64 * 1024 * 1024, (grown, index_bytes)
