"""Admission: a create is either accepted and queued in full, or refused with a Retry-After.

Concurrent creates at an embedded service whose intake pool fits only some of them: every create
either returns a batch that completes with all its lines, or raises IntakeFull with a Retry-After
of 1..300 s; no accepted batch ends ``capacity_exceeded``. A batch larger than the whole pool still
ends ``capacity_exceeded``. The drain meter turns recent finishes into that Retry-After, and the
pacer hands turns to parked request tasks in order.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from batchgen.core import BatchService, BatchStatus, ServiceSettings, load_backend
from batchgen.core.errors import IntakeFull
from batchgen.core.scheduling.drain_meter import DrainMeter
from batchgen.core.scheduling.pacer import Pacer


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
    assert meter.wait_for(5) == 10  # nothing finished yet: look again after one window
    for _ in range(10):
        clock.now += 1
        meter.record(20)
    assert meter.rate() == pytest.approx(20, rel=0.15)
    assert meter.wait_for(100) == 5
    assert meter.wait_for(0) == 1  # never less than a second
    assert meter.wait_for(10**9) == 300  # never more than five minutes
    clock.now += 60  # the finishes left the window: the rate follows the current load
    assert meter.rate() == 0 and meter.wait_for(100) == 10


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
