"""Stateful test of slots shared between models (``ModelShares`` in the real ``Scheduler``).

``ModelSharesMachine`` drives the real ``IntakePool``, ``SchedulingPool`` and ``Scheduler`` with
batches of several models arriving, admissions and finishes in random order, and checks:

1. Capacity: running requests never exceed the slots; per-model counts add up to the running total.
2. Work conservation: after ``admit``, either no slot is free or nothing is queued.
3. Fair shares: a request is admitted only for a model holding fewer slots than its share
   (``ceil(capacity / models with queued work)``), so while one model holds more, every freed
   slot goes to the others; and no starvation: a model with queued work, below its share, is
   admitted within as many finishes as the most batches queued while it waited (batches take
   turns, so every batch ahead of its own may take one slot first, even batches that have
   drained since).
4. Conservation: every request is admitted once and finished once.
"""

from __future__ import annotations

from array import array

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchgen.core.files.batch_file import LineIndex
from batchgen.core.scheduling import IntakeEntry, IntakePool, Scheduler, SchedulingPool
from batchgen.core.scheduling.model_shares import ModelShares
from tests.examples import examples

MODELS = ("chat", "emb", "big")


def _index(lines: int) -> LineIndex:
    return LineIndex(array("q", range(0, lines * 10, 10)), array("l", [10] * lines))


async def _never_run(entry: IntakeEntry) -> None:  # the machine calls admit/finish itself
    raise AssertionError("not used")


class ModelSharesMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 6))
    def setup(self, capacity: int) -> None:
        self.capacity = capacity
        self.batch_models: dict[str, str] = {}
        self.intake = IntakePool(10_000)
        self.slots = SchedulingPool(capacity)
        self.shares = ModelShares(capacity, self.batch_models.__getitem__)
        self.scheduler = Scheduler(self.intake, self.slots, _never_run, self.shares)
        self.running: list[IntakeEntry] = []
        self.admitted: set[tuple[str, int]] = set()
        self.finished: set[tuple[str, int]] = set()
        self.batches = 0
        #: finishes since each model with queued work last got a slot
        self.waiting_finishes: dict[str, int] = {}
        #: the most batches queued at those finishes
        self.waiting_batches: dict[str, int] = {}

    def _queued_models(self) -> set[str]:
        return {self.batch_models[batch] for batch in self.intake.queued_batches()}

    @rule(model=st.sampled_from(MODELS), lines=st.integers(1, 12))
    def add_batch(self, model: str, lines: int) -> None:
        batch_id = f"b{self.batches}"
        self.batches += 1
        self.batch_models[batch_id] = model
        self.intake.add(batch_id, _index(lines))
        self.waiting_finishes.setdefault(model, 0)

    @rule()
    def admit(self) -> None:
        while True:
            share = self.shares.share(len(self._queued_models()))
            held = {model: self.shares.running(model) for model in MODELS}
            entries = self.scheduler.admit(limit=1)
            if not entries:
                break
            [entry] = entries
            key = (entry.batch_id, entry.line)
            assert key not in self.admitted
            self.admitted.add(key)
            model = self.batch_models[entry.batch_id]
            assert held[model] < share  # only a model under its share takes a slot
            self.waiting_finishes[model] = 0
            self.waiting_batches[model] = 0
            self.running.append(entry)
        # work conservation
        assert self.slots.free == 0 or self.intake.size == 0

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        entry = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.scheduler.finish(entry)
        self.finished.add((entry.batch_id, entry.line))
        queued = self._queued_models()
        share = self.shares.share(len(queued))
        queued_batches = len(list(self.intake.queued_batches()))
        for model in queued:
            if self.shares.running(model) < share:
                self.waiting_finishes[model] = self.waiting_finishes.get(model, 0) + 1
                self.waiting_batches[model] = max(self.waiting_batches.get(model, 0), queued_batches)
        self.admit()

    @invariant()
    def capacity_holds(self) -> None:
        if not hasattr(self, "slots"):
            return
        assert self.slots.active == len(self.running) <= self.capacity
        assert sum(self.shares.running(model) for model in MODELS) == self.slots.active

    @invariant()
    def nobody_starves(self) -> None:
        if not hasattr(self, "slots"):
            return
        for model in self._queued_models():
            waited = self.waiting_finishes.get(model, 0)
            assert waited <= self.waiting_batches.get(model, 0), (model, waited, self.waiting_batches)

    @invariant()
    def each_request_once(self) -> None:
        if not hasattr(self, "slots"):
            return
        assert self.finished <= self.admitted
        assert len(self.admitted) == len(self.finished) + len(self.running)


ModelSharesMachine.TestCase.settings = settings(
    max_examples=examples(200), stateful_step_count=60, deadline=None
)
TestModelSharesMachine = ModelSharesMachine.TestCase


def test_a_late_model_gets_the_slots_a_big_batch_frees() -> None:
    """One model's big batch fills every slot; another model's batch then gets each freed slot
    until it holds its share, instead of waiting for the big batch to drain."""
    models = {"big": "chat", "small": "emb"}
    intake, slots = IntakePool(1000), SchedulingPool(4)
    scheduler = Scheduler(intake, slots, _never_run, ModelShares(4, models.__getitem__))
    intake.add("big", _index(100))
    running = scheduler.admit()
    assert [entry.batch_id for entry in running] == ["big"] * 4
    intake.add("small", _index(10))
    assert scheduler.admit() == []  # no free slot
    got: list[str] = []
    for _ in range(2):
        scheduler.finish(running.pop(0))
        got.extend(entry.batch_id for entry in scheduler.admit())
    assert got == ["small", "small"]  # both freed slots went to the waiting model
    scheduler.finish(running.pop(0))
    assert [entry.batch_id for entry in scheduler.admit()] == ["big"]  # shares now equal: 2 and 2
