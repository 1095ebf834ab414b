"""Deadlines in the intake pool: earliest deadline first within a tenant, no batch starves, and
tenants' shares do not move (``scheduling.deadline_turns``).

The model both machines assume: the real ``IntakePool`` and ``Scheduler`` with **one slot**, and
every request takes exactly **one step** (it is admitted at the start of a step and finishes at
its end), so a request's cost is known and equal for all. A batch added at step ``r`` with
deadline ``d`` (a step number) meets it when each of its requests is admitted at a step ``< d``.

``DeadlineMachine`` (one tenant) states:

- No starvation: a batch with queued work is admitted within ``FAIR_TURN_EVERY * m`` steps,
  ``m`` being the most batches with queued work meanwhile, whatever the deadlines.
- Deadlines: fair turns take at most ``ceil(L / FAIR_TURN_EVERY)`` of any ``L`` consecutive
  steps. Whenever some order meets every deadline on the steps left once that many are set aside
  in every window (checked independently of the pool, by Hall's condition for unit jobs: for
  every release ``r`` and deadline ``d``, the requests released at or after ``r`` and due by ``d``
  fit in the steps of ``[r, d)`` left), the pool meets every deadline.

``TenantShareMachine`` (three tenants of random weights) runs the same operations on two pools,
one given random deadlines and one none, and states that every admission goes to the same tenant
in both: deadlines never change which tenant is served, only which of its batches.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchgen.core.batches.options import parse_completion_window
from batchgen.core.scheduling import IntakeEntry, IntakePool, Scheduler, SchedulingPool
from batchgen.core.scheduling.deadline_turns import DEADLINE_GRID_SHARE, deadline_grid, deadline_slot
from batchgen.core.scheduling.intake_pool import FAIR_TURN_EVERY
from tests.core.test_scheduling_state_machines import make_index
from tests.examples import examples


async def _not_run(entry: IntakeEntry) -> None:
    raise AssertionError("the state machines never start the run loop")


def _one_slot_scheduler(intake: IntakePool) -> Scheduler:
    return Scheduler(intake, SchedulingPool(1), _not_run)


def feasible_with_fair_turns(jobs: list[tuple[int, int]]) -> bool:
    """Whether unit jobs ``(release, deadline)`` can all meet their deadlines on one machine that
    loses ``ceil(L / FAIR_TURN_EVERY)`` of any ``L`` consecutive steps (Hall's condition)."""
    releases = sorted({release for release, _ in jobs})
    deadlines = sorted({deadline for _, deadline in jobs})
    for start in releases:
        for end in deadlines:
            if end <= start:
                continue
            length = end - start
            usable = length - math.ceil(length / FAIR_TURN_EVERY)
            due = sum(1 for release, deadline in jobs if release >= start and deadline <= end)
            if due > usable:
                return False
    return True


class DeadlineMachine(RuleBasedStateMachine):
    """One tenant's batches with random deadlines, run a step at a time on one slot."""

    @initialize()
    def setup(self) -> None:
        self.intake = IntakePool(10_000)
        self.scheduler = _one_slot_scheduler(self.intake)
        self.step_number = 0
        self.count = 0
        self.deadline: dict[str, int] = {}
        self.released: dict[str, int] = {}
        self.queued: Counter[str] = Counter()
        self.admitted_at: dict[tuple[str, int], int] = {}
        # waited[b]: steps since b was last admitted (or queued); most[b]: most batches queued meanwhile
        self.waited: dict[str, int] = {}
        self.most: dict[str, int] = {}

    @rule(size=st.integers(1, 8), due_in=st.integers(1, 150), twin=st.booleans())
    def add_batch(self, size: int, due_in: int, twin: bool) -> None:
        """A batch due ``due_in`` steps from now (or, with ``twin``, due with the last one added)."""
        batch_id = f"b{self.count}"
        self.count += 1
        deadline = self.step_number + due_in
        if twin and self.deadline:
            deadline = max(self.deadline[f"b{self.count - 2}"], self.step_number + 1)
        self.intake.add(batch_id, make_index(0, [5] * size), deadline=deadline)
        self.deadline[batch_id] = deadline
        self.released[batch_id] = self.step_number
        self.queued[batch_id] = size
        self.waited[batch_id] = 0
        self.most[batch_id] = len(self.queued)
        for other in self.most:
            self.most[other] = max(self.most[other], len(self.queued))

    @precondition(lambda self: self.queued)
    @rule(steps=st.integers(1, 20))
    def run_steps(self, steps: int) -> None:
        for _ in range(steps):
            self._step()

    def _step(self) -> None:
        if not self.queued:  # an idle step
            assert self.scheduler.admit() == []
            self.step_number += 1
            return
        [entry] = self.scheduler.admit()  # one slot, free at the start of every step
        batch_id = entry.batch_id
        assert self.queued[batch_id] > 0, f"{batch_id} was admitted with nothing queued"
        self.admitted_at[(batch_id, entry.line)] = self.step_number
        self.queued[batch_id] -= 1
        for other in self.waited:
            if other != batch_id:
                self.waited[other] += 1
                bound = FAIR_TURN_EVERY * self.most[other]
                assert self.waited[other] <= bound, (
                    f"{other} waited {self.waited[other]} steps with queued work (bound {bound})"
                )
        self.waited[batch_id] = 0
        self.most[batch_id] = len(self.queued)
        if not self.queued[batch_id]:
            del self.queued[batch_id], self.waited[batch_id], self.most[batch_id]
        self.scheduler.finish(entry)
        self.step_number += 1

    @invariant()
    def pool_matches_model(self) -> None:
        if hasattr(self, "intake"):
            assert self.intake.size == sum(self.queued.values())

    def teardown(self) -> None:
        if not hasattr(self, "intake"):
            return
        while self.queued:
            self._step()
        assert self.intake.size == 0
        jobs = [
            (self.released[batch_id], self.deadline[batch_id]) for batch_id, _ in sorted(self.admitted_at)
        ]
        if feasible_with_fair_turns(jobs):
            late = {
                request: (step, self.deadline[request[0]])
                for request, step in self.admitted_at.items()
                if step >= self.deadline[request[0]]
            }
            assert not late, f"requests admitted at or after their deadline step: {late}"


DeadlineMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=40, deadline=None
)
TestDeadlineMachine = DeadlineMachine.TestCase

TENANTS = ("alpha", "beta", "gamma")


class TenantShareMachine(RuleBasedStateMachine):
    """The same operations on a pool with deadlines and on one without: the same tenants served."""

    @initialize(weights=st.tuples(*[st.sampled_from([0.5, 1.0, 2.0, 3.0])] * len(TENANTS)))
    def setup(self, weights: tuple[float, ...]) -> None:
        self.with_deadlines = IntakePool(10_000)
        self.without = IntakePool(10_000)
        for pool in (self.with_deadlines, self.without):
            for tenant, weight in zip(TENANTS, weights, strict=True):
                pool.set_weight(tenant, weight)
        self.schedulers = [_one_slot_scheduler(self.with_deadlines), _one_slot_scheduler(self.without)]
        self.count = 0
        self.batches: list[str] = []
        self.tenant_of: dict[str, str] = {}
        self.served: Counter[str] = Counter()

    @rule(tenant=st.sampled_from(TENANTS), size=st.integers(1, 30), deadline=st.integers(0, 10**6))
    def add_batch(self, tenant: str, size: int, deadline: int) -> None:
        batch_id = f"b{self.count}"
        self.count += 1
        self.with_deadlines.add(batch_id, make_index(0, [5] * size), tenant=tenant, deadline=deadline)
        self.without.add(batch_id, make_index(0, [5] * size), tenant=tenant)
        self.batches.append(batch_id)
        self.tenant_of[batch_id] = tenant

    @rule(tenant=st.sampled_from(TENANTS))
    def cancel_all_of(self, tenant: str) -> None:
        """Every batch of a tenant is cancelled (a single batch would leave the two pools holding
        different work: which of its batches drained first is what deadlines change)."""
        dropped = [
            sum(pool.drop(batch_id) for batch_id in self.batches if self.tenant_of[batch_id] == tenant)
            for pool in (self.with_deadlines, self.without)
        ]
        assert dropped[0] == dropped[1]

    @rule(steps=st.integers(1, 40))
    def run_steps(self, steps: int) -> None:
        for _ in range(steps):
            admitted = [scheduler.admit() for scheduler in self.schedulers]
            tenants = [[self.tenant_of[entry.batch_id] for entry in entries] for entries in admitted]
            assert tenants[0] == tenants[1], f"deadlines moved an admission between tenants: {tenants}"
            for scheduler, entries in zip(self.schedulers, admitted, strict=True):
                for entry in entries:
                    scheduler.finish(entry)
            self.served.update(tenants[0])

    @invariant()
    def same_queued_per_tenant(self) -> None:
        if hasattr(self, "with_deadlines"):
            assert self.with_deadlines.tenants_queued() == self.without.tenants_queued()


TenantShareMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None
)
TestTenantShareMachine = TenantShareMachine.TestCase


@given(
    far=st.integers(50, 400),
    near=st.integers(1, 40),
    gap=st.integers(60, 10**6),
    head_start=st.integers(0, 10),
)
@settings(max_examples=examples(100), deadline=None)
def test_a_near_deadline_behind_a_far_one_of_the_same_tenant_finishes_first(
    far: int, near: int, gap: int, head_start: int
) -> None:
    """A batch due soon, queued behind a bigger one due much later, drains first, while the far
    one keeps at least one admission in FAIR_TURN_EVERY; with equal deadlines they take turns."""
    intake = IntakePool(10_000)
    scheduler = _one_slot_scheduler(intake)
    intake.add("far", make_index(0, [5] * far), tenant="t", deadline=1_000 + gap)
    taken: list[str] = []

    def step() -> None:
        [entry] = scheduler.admit()
        taken.append(entry.batch_id)
        scheduler.finish(entry)

    for _ in range(head_start):
        step()
    intake.add("near", make_index(0, [5] * near), tenant="t", deadline=1_000)
    while intake.queued("near"):
        step()
    after = taken[head_start:]
    assert intake.queued("far") > 0, "the far batch drained first"
    assert after.count("far") <= math.ceil(len(after) / FAIR_TURN_EVERY)
    assert after.count("far") >= len(after) // FAIR_TURN_EVERY - 1


def test_the_minimum_share_is_one_admission_in_eight() -> None:
    """The share docs/architecture.md and docs/api.md state; the bounds above are in its terms."""
    assert FAIR_TURN_EVERY == 8
    intake = IntakePool(1_000)
    intake.add("far", make_index(0, [5] * 100), tenant="t", deadline=10**9)
    intake.add("near", make_index(0, [5] * 100), tenant="t", deadline=10)
    order = [entry.batch_id for entry in Scheduler(intake, SchedulingPool(80), _not_run).admit()]
    assert order == (["near"] * 7 + ["far"]) * 10


def test_equal_deadlines_take_turns_as_without_deadlines() -> None:
    intake = IntakePool(100)
    for batch_id in ("a", "b", "c"):
        intake.add(batch_id, make_index(0, [5] * 4), tenant="t", deadline=500)
    order = [entry.batch_id for entry in Scheduler(intake, SchedulingPool(12), _not_run).admit()]
    assert order == ["a", "b", "c"] * 4


def test_a_deadline_must_be_a_number_and_a_refused_one_changes_nothing() -> None:
    intake = IntakePool(10)
    intake.reserve("a", 3, "t")
    with pytest.raises(ValueError):
        intake.add("a", make_index(0, [5] * 3), deadline=float("nan"))
    assert (intake.size, intake.reserved_for("a"), "a" in intake) == (0, 3, False)
    assert intake.add("a", make_index(0, [5] * 3), deadline=7) == 3


@given(
    batches=st.lists(
        st.tuples(st.sampled_from(TENANTS), st.integers(1, 12), st.integers(0, 50), st.booleans()),
        min_size=1,
        max_size=12,
    ),
)
@settings(max_examples=examples(200), deadline=None)
def test_with_model_shares_only_admissible_batches_are_taken_and_each_request_once(
    batches: list[tuple[str, int, int, bool]],
) -> None:
    """The pop the scheduler uses with several models (``admissible``): deadlines or not, it takes
    only batches the test admits, each queued request once, and stops only when none is left."""
    intake = IntakePool(10_000)
    allowed = set()
    for number, (tenant, size, deadline, admissible) in enumerate(batches):
        intake.add(f"b{number}", make_index(0, [5] * size), tenant=tenant, deadline=deadline)
        if admissible:
            allowed.add(f"b{number}")
    taken: Counter[tuple[str, int]] = Counter()
    while (entry := intake.pop(lambda batch_id: batch_id in allowed)) is not None:
        assert entry.batch_id in allowed
        taken[(entry.batch_id, entry.line)] += 1
    assert all(count == 1 for count in taken.values())
    expected = {(f"b{n}", line) for n, (_, size, _, ok) in enumerate(batches) if ok for line in range(size)}
    assert set(taken) == expected
    assert intake.size == sum(size for _, size, _, ok in batches if not ok)


# --- the deadline a batch is queued with (deadline_slot) ---------------------------------------

_WINDOWS = st.integers(1, 365 * 86400)
_CREATED = st.integers(1_600_000_000, 2_000_000_000)


@given(_CREATED, _WINDOWS, _CREATED, _WINDOWS)
def test_deadlines_further_apart_than_their_grid_keep_their_order(
    created_a: int, window_a: int, created_b: int, window_b: int
) -> None:
    """A slot is never before its deadline nor a grid past it, and a deadline at least its own grid
    before another never gets the later slot."""
    a_due, b_due = created_a + window_a, created_b + window_b
    slot_a, slot_b = deadline_slot(created_a, a_due), deadline_slot(created_b, b_due)
    grid_a = deadline_grid(window_a)
    assert a_due <= slot_a < a_due + grid_a
    assert grid_a >= window_a * DEADLINE_GRID_SHARE
    if a_due + grid_a <= b_due:
        assert slot_a <= slot_b


@given(_CREATED, st.sampled_from(["1h", "24h", "7d"]), st.integers(0, 600))
def test_batches_of_one_window_created_minutes_apart_take_turns(created: int, window: str, gap: int) -> None:
    """Two batches of the same window created up to ten minutes apart usually share one slot;
    when they do, the later one is admitted every other time, as without deadlines."""
    window_s = parse_completion_window(window)
    first = deadline_slot(created, created + window_s)
    second = deadline_slot(created + gap, created + gap + window_s)
    assert first <= second
    if first != second:  # a grid edge (or, for a gap wider than the grid, several) fell between them
        grid = deadline_grid(window_s)
        assert (second - first) % grid == 0 and second - first <= gap + grid
        return
    intake = IntakePool(10_000)
    scheduler = _one_slot_scheduler(intake)
    intake.add("first", make_index(0, [5] * 40), tenant="t", deadline=first)
    intake.add("second", make_index(0, [5] * 10), tenant="t", deadline=second)
    taken = []
    for _ in range(20):
        [entry] = scheduler.admit()
        taken.append(entry.batch_id)
        scheduler.finish(entry)
    assert taken.count("second") == 10


def test_a_24h_batch_created_a_minute_after_another_shares_its_slot_mostly() -> None:
    """The share of creation moments where a one-minute gap splits two 24h deadlines is the gap
    over the grid (4.55 h): under 1 in 200."""
    window_s = parse_completion_window("24h")
    created = range(1_700_000_000, 1_700_000_000 + 86400, 37)
    split = sum(deadline_slot(c, c + window_s) != deadline_slot(c + 60, c + 60 + window_s) for c in created)
    assert 0 < split < len(created) / 200
