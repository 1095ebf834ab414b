"""ShardSlots, as a Hypothesis state machine: lines of several shards wait, end and are cancelled.

Checked after every step: never more lines run than there are slots; no slot is free while a
line waits; the running counts are the lines granted and not yet ended; a slot that came free
went to a waiting shard with the fewest lines running then; a cancelled wait holds no slot. And
the reason it exists: a shard that starts waiting behind hundreds of another shard's lines gets
the next slot that comes free.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from batchgen.core.work.shard_slots import ShardSlots
from tests.examples import examples

SHARDS = ("a", "b", "c", "d")


class SlotsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.slots: ShardSlots | None = None
        self.tasks: list[tuple[str, asyncio.Task[None]]] = []
        self.ended: set[int] = set()  # ids of granted tasks whose line ended

    def teardown(self) -> None:
        for _, task in self.tasks:
            task.cancel()
        self._settle()
        self.loop.close()

    def _settle(self) -> None:
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))

    def _granted(self) -> list[tuple[str, asyncio.Task[None]]]:
        return [
            (shard, task)
            for shard, task in self.tasks
            if task.done() and not task.cancelled() and id(task) not in self.ended
        ]

    def _waiting(self) -> list[tuple[str, asyncio.Task[None]]]:
        return [(shard, task) for shard, task in self.tasks if not task.done()]

    @rule(capacity=st.integers(1, 5))
    @precondition(lambda self: self.slots is None)
    def make(self, capacity: int) -> None:
        self.slots = ShardSlots(capacity)

    @precondition(lambda self: self.slots is not None)
    @rule(shard=st.sampled_from(SHARDS), count=st.integers(1, 4))
    def wait(self, shard: str, count: int) -> None:
        assert self.slots is not None
        for _ in range(count):
            self.tasks.append((shard, self.loop.create_task(self.slots.acquire(shard))))
        self._settle()

    @precondition(lambda self: self.slots is not None and self._granted())
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        assert self.slots is not None
        shard, task = data.draw(st.sampled_from(self._granted()))
        running_before = Counter(s for s, _ in self._granted())
        waiting_before = {s for s, _ in self._waiting()}
        granted_before = {id(t) for _, t in self._granted()}
        self.ended.add(id(task))
        self.slots.release(shard)
        self._settle()
        newly = [s for s, t in self._granted() if id(t) not in granted_before]
        if waiting_before:
            assert len(newly) == 1, "a freed slot went to no waiting line, or to several"
            running_before[shard] -= 1
            fewest = min(running_before[s] for s in waiting_before)
            assert running_before[newly[0]] == fewest, (newly, running_before, waiting_before)
        else:
            assert newly == []

    @precondition(lambda self: self.slots is not None and self._waiting())
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        _, task = data.draw(st.sampled_from(self._waiting()))
        task.cancel()
        self._settle()
        assert task.cancelled()

    @invariant()
    def slots_are_counted(self) -> None:
        if self.slots is None:
            return
        granted = Counter(shard for shard, _ in self._granted())
        assert sum(granted.values()) <= self.slots.capacity
        assert self.slots.free == self.slots.capacity - sum(granted.values())
        assert all(self.slots.running(shard) == granted[shard] for shard in SHARDS)
        waiting = Counter(shard for shard, _ in self._waiting())
        assert all(self.slots.waiting(shard) == waiting[shard] for shard in SHARDS)
        if waiting:
            assert self.slots.free == 0, "a slot is free while a line waits"


SlotsMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
test_shard_slots_machine = SlotsMachine.TestCase


@pytest.mark.anyio
async def test_a_shard_waiting_behind_another_shards_many_lines_gets_the_next_free_slot() -> None:
    slots = ShardSlots(4)
    first = [asyncio.ensure_future(slots.acquire("big")) for _ in range(500)]
    await asyncio.sleep(0)
    late = asyncio.ensure_future(slots.acquire("taken-over"))
    await asyncio.sleep(0)
    assert slots.running("big") == 4 and not late.done()
    slots.release("big")
    await asyncio.sleep(0)
    assert late.done() and slots.running("taken-over") == 1  # not after the other 496
    for task in first:
        task.cancel()
    await asyncio.gather(*first, return_exceptions=True)


def test_a_replica_runs_at_least_one_line() -> None:
    with pytest.raises(ValueError, match="at least one line"):
        ShardSlots(0)
