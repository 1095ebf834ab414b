"""Admission: a create is either accepted and queued in full, or refused with a Retry-After.

Concurrent creates at an embedded service whose intake pool fits only some of them: every create
either returns a batch that completes with all its lines, or raises IntakeFull with a Retry-After
of 1..300 s; no accepted batch ends ``capacity_exceeded``. A batch larger than the whole pool still
ends ``capacity_exceeded``. The drain meter turns recent finishes into that Retry-After, and the
pacer hands turns to parked request tasks in order.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, BatchStatus, ServiceSettings, load_backend
from batchgen.core.errors import IntakeFull
from batchgen.core.scheduling.drain_meter import DrainMeter
from batchgen.core.scheduling.pacer import Pacer
from tests.examples import examples


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _file(prefix: str, count: int) -> bytes:
    lines = (
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "default", "messages": [{"role": "user", "content": f"q {i}"}]},
        }
        for i in range(count)
    )
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@pytest.mark.anyio
async def test_concurrent_creates_are_accepted_in_full_or_refused_with_retry_after(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, max_intake_capacity=20, max_pool_size=2)
    async with BatchService(settings, load_backend("simulated", latency_s=0.02)) as service:
        files = [await service.create_file(_file(f"b{n}", 6), filename=f"b{n}.jsonl") for n in range(8)]
        accepted: list[str] = []
        refused: list[IntakeFull] = []

        async def create(file_id: str) -> None:
            await anyio.sleep(0)
            try:
                batch = await service.create_batch(file_id, "/v1/chat/completions")
            except IntakeFull as exc:
                refused.append(exc)
            else:
                accepted.append(batch.id)

        async with anyio.create_task_group() as tasks:
            for file in files:
                tasks.start_soon(create, file.id)

        assert len(accepted) == 3 and len(refused) == 5, (accepted, refused)  # 3 x 6 fit in 20
        for exc in refused:
            assert 1 <= exc.retry_after_s <= 300 and exc.code == "capacity_exceeded"
        for batch_id in accepted:
            batch = await service.wait_for_batch(batch_id, poll_interval=0.01)
            assert batch.status is BatchStatus.COMPLETED, batch.error
            assert batch.request_counts.completed == 6
        assert service.intake_pool.free == 20 and service.intake_pool.reserved == 0
        # The pool drained, so a refused batch is accepted now.
        later = await service.create_batch(files[-1].id, "/v1/chat/completions")
        assert (await service.wait_for_batch(later.id, poll_interval=0.01)).status is BatchStatus.COMPLETED


@pytest.mark.anyio
async def test_cancel_before_indexing_gives_the_reservation_back(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, max_intake_capacity=10)
    async with BatchService(settings, load_backend("simulated")) as service:
        file = await service.create_file(_file("c", 10), filename="c.jsonl")
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        assert service.intake_pool.free == 0  # held from the moment it was accepted
        await service.cancel_batch(batch.id)
        ended = await service.wait_for_batch(batch.id, poll_interval=0.01)
        assert ended.status is BatchStatus.CANCELLED
        assert service.intake_pool.reserved == 0 and service.intake_pool.free == 10


@pytest.mark.anyio
async def test_batch_larger_than_the_pool_still_fails_capacity_exceeded(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, max_intake_capacity=3)
    async with BatchService(settings, load_backend("simulated")) as service:
        file = await service.create_file(_file("big", 4), filename="big.jsonl")
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        ended = await service.wait_for_batch(batch.id, poll_interval=0.01)
        assert ended.status is BatchStatus.FAILED and ended.error is not None
        assert ended.error.code == "capacity_exceeded"
        assert service.intake_pool.free == 3


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_drain_meter_estimates_from_recent_finishes() -> None:
    clock = _Clock()
    meter = DrainMeter(window_s=10, clock=clock)
    clock.now += 500  # idle long before the work begins: that time is not part of the rate
    meter.admitted(40)
    assert meter.wait_for(5) == 1  # nothing finished yet, and the work has only just begun
    clock.now += 3.5
    assert meter.wait_for(5) == 4  # nothing finished in 3.5 s: look again after as long
    for _ in range(10):
        clock.now += 1
        meter.record(20)
        meter.admitted(20)
    assert meter.rate() == pytest.approx(20, rel=0.15)
    assert meter.wait_for(100) == 5
    assert meter.wait_for(0) == 1  # never less than a second
    assert meter.wait_for(10**9) == 300  # never more than five minutes
    clock.now += 60  # the finishes left the window: the rate follows the current load
    assert meter.rate() == 0 and meter.wait_for(100) == 10  # nothing for a window: look again after one


def test_a_new_busy_period_measures_afresh_and_a_refilled_slot_continues_the_old_one() -> None:
    clock = _Clock()
    meter = DrainMeter(window_s=30, clock=clock)
    meter.admitted(1)
    for _ in range(4):  # one slot, refilled the moment it frees: one busy period
        clock.now += 2
        meter.record()
        meter.admitted()
    assert meter.rate() == pytest.approx(0.5)
    clock.now += 2
    meter.record()  # the slot stands empty ...
    clock.now += 5
    meter.admitted()  # ... long enough that this admission begins a new busy period
    clock.now += 1
    assert meter.rate() == 0 and meter.wait_for(3) == 1
    meter.record(4)
    assert meter.rate() == pytest.approx(4)  # 4 in the one second since it began, not in the last 13


@settings(max_examples=examples(300), deadline=None)
@given(
    created_at=st.floats(0, 1, exclude_max=True),
    idle_s=st.floats(0, 3600),
    window_s=st.sampled_from([1.0, 10.0, 30.0, 45.5]),
    in_flight=st.integers(1, 64),
    rate=st.floats(0.02, 100),
    busy_s=st.floats(0, 90),
    places=st.integers(-5, 100_000),
)
def test_retry_after_is_at_least_a_second_and_never_far_above_the_drain_time(
    created_at: float,
    idle_s: float,
    window_s: float,
    in_flight: int,
    rate: float,
    busy_s: float,
    places: int,
) -> None:
    """The slots finish one request every ``1 / rate`` seconds, each refilled at once, from the
    moment the work began (after the meter stood idle for ``idle_s``). However long the work has
    run, the estimate for ``places`` more to finish is at least a second and at most twice their
    drain time at that rate (a single finish seen early may halve the measured rate), never a
    fixed fallback above it."""
    clock = _Clock()
    clock.now += created_at
    meter = DrainMeter(window_s=window_s, clock=clock)
    clock.now += idle_s
    began = clock.now
    meter.admitted(in_flight)
    finish_times = (began + (i + 1) / rate for i in range(math.floor(busy_s * rate)))
    for _, same_second in itertools.groupby(finish_times, key=int):
        times = list(same_second)
        clock.now = times[-1]  # a bucket counts whole seconds: the finishes of one second at once
        meter.record(len(times))
        meter.admitted(len(times))
    clock.now = began + busy_s
    retry_after = meter.wait_for(places)
    assert 1 <= retry_after <= 300
    drain_s = max(places, 0) / rate
    assert retry_after <= max(1, math.ceil(2 * drain_s * (1 + 1e-9)))


@pytest.mark.anyio
async def test_pacer_wakes_parked_tasks_in_order_a_few_per_turn() -> None:
    pacer = Pacer(budget_s=0.0, wake_per_turn=2)  # no budget: every task parks
    order: list[int] = []

    async def task(n: int) -> None:
        await pacer.pace()
        order.append(n)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(pacer.run)
        async with anyio.create_task_group() as workers:
            for n in range(7):
                workers.start_soon(task, n)
        tasks.cancel_scope.cancel()
    assert order == list(range(7))
    assert pacer.parked == 0
