"""The scheduler's run loop with a group runner: requests handed over in groups, reported as they end.

The runner reports the requests of each group at random moments (at once, after a sleep, several
in one call, or never, leaving them to the end of the group), sometimes raises, and checks as it
goes that a slot freed while work is queued was refilled in the same step. Afterwards each
request ran exactly once, no group was larger than ``group_size``, and every slot came back.
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import pytest

from batchgen.core.files.batch_file import LineIndex
from batchgen.core.scheduling import Finished, IntakeEntry, IntakePool, Scheduler, SchedulingPool
from batchgen.core.scheduling import scheduler as scheduler_module

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_index(lengths: list[int]) -> LineIndex:
    offsets = array("q")
    position = 0
    for length in lengths:
        offsets.append(position)
        position += length
    return LineIndex(offsets=offsets, lengths=array("l", lengths))


@pytest.mark.parametrize("seed", range(6))
async def test_groups_run_each_request_once_and_refill_freed_slots_at_once(seed: int) -> None:
    rng = random.Random(seed)
    group_size = rng.choice([1, 3, 8])
    intake, slots = IntakePool(200), SchedulingPool(rng.choice([4, 10, 25]))
    started: Counter[tuple[str, int]] = Counter()
    group_sizes: list[int] = []
    not_refilled: list[str] = []

    async def run_group(entries: Sequence[IntakeEntry], finished: Finished) -> None:
        group_sizes.append(len(entries))
        assert slots.active <= slots.capacity
        for entry in entries:
            started[(entry.batch_id, entry.line)] += 1
        waiting = list(range(len(entries)))
        rng.shuffle(waiting)
        while waiting:
            roll = rng.random()
            if roll < 0.1:
                raise RuntimeError("the runner failed; the scheduler frees what is left")
            if roll < 0.2:
                return  # the rest are freed when the group ends
            if roll < 0.6:
                await anyio.sleep(rng.uniform(0, 0.002))
            count = rng.randint(1, 3)
            ending, waiting = waiting[:count], waiting[count:]
            free_before = slots.free
            finished(*ending)
            finished(*ending)  # a second report of the same requests changes nothing
            if intake.size and slots.free > free_before:
                not_refilled.append(f"{slots.free - free_before} freed slots idle, {intake.size} queued")

    scheduler = Scheduler(intake, slots, run_group=run_group, group_size=group_size)
    expected: set[tuple[str, int]] = set()
    async with anyio.create_task_group() as tasks:
        await tasks.start(scheduler.run)
        for number in range(12):
            size = rng.randint(1, 30)
            batch_id = f"batch_{number}"
            with anyio.fail_after(10):
                while intake.free < size:
                    await anyio.sleep(0.001)
            intake.add(batch_id, make_index([rng.randint(1, 99) for _ in range(size)]))
            scheduler.notify()
            expected.update((batch_id, line) for line in range(size))
            await anyio.sleep(rng.uniform(0, 0.003))
        with anyio.fail_after(10):
            await scheduler.wait_until_idle()
        tasks.cancel_scope.cancel()

    assert set(started) == expected, "a request never ran"
    assert all(count == 1 for count in started.values()), "a request ran twice"
    assert max(group_sizes) <= group_size
    assert (slots.active, intake.size) == (0, 0)
    assert not not_refilled, not_refilled[:3]


def test_a_scheduler_needs_a_runner() -> None:
    with pytest.raises(TypeError):
        Scheduler(IntakePool(1), SchedulingPool(1))
    with pytest.raises(ValueError):
        Scheduler(
            IntakePool(1), SchedulingPool(1), run_group=lambda entries, finished: anyio.sleep(0), group_size=0
        )


async def test_slots_freed_one_at_a_time_are_refilled_as_one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freed slots gather into one refill group, which runs as soon as it is full (here long
    before the gathering window ends), rather than one group per freed slot."""
    monkeypatch.setattr(scheduler_module, "REFILL_GATHER_S", 30.0)
    group_size = 4
    intake, slots = IntakePool(100), SchedulingPool(group_size)
    groups: list[int] = []
    first_group_running = anyio.Event()
    release_first: list[Finished] = []

    async def run_group(entries: Sequence[IntakeEntry], finished: Finished) -> None:
        groups.append(len(entries))
        if len(groups) == 1:
            release_first.append(finished)
            first_group_running.set()
            await anyio.sleep_forever()

    scheduler = Scheduler(intake, slots, run_group=run_group, group_size=group_size)
    async with anyio.create_task_group() as tasks:
        await tasks.start(scheduler.run)
        intake.add("batch_a", make_index([10] * 12))
        scheduler.notify()
        with anyio.fail_after(5):
            await first_group_running.wait()
            for position in range(group_size):  # one slot at a time, a turn of the loop apart
                release_first[0](position)
                await anyio.lowlevel.checkpoint()
            while len(groups) < 2:
                await anyio.sleep(0.001)
        tasks.cancel_scope.cancel()
    assert groups[:2] == [group_size, group_size], "the four freed slots became one group, at once"
