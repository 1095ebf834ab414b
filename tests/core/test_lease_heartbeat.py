"""Leases renewed from the heartbeat's own thread, whatever the event loop is doing, on a real PostgreSQL.

A runner whose event loop is blocked (``time.sleep`` on the loop) for most of a lease, again and
again, keeps every lease and stays healthy: the renewals land meanwhile, and the batch ends with
each line once. A loop blocked for longer than a lease stops the renewals, so its leases run out
as a dead replica's would. An embedded replica with
``--max-pool-size``'s default (10,240 lines at once) runs thousands of lines at once through a
30,000-line batch on a loop kept busy besides, without losing a lease or going unhealthy.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import anyio
import psycopg
import pytest

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.execution.shared_storage import SharedStorage
from batchgen.core.models import GenerationRequest, GenerationResult
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.shard_runner import LineResult, ShardRunner
from batchgen.core.work.shards import ERRORS, OUTPUT
from tests.helpers import chat_line, jsonl
from tests.work_replica import result_line

pytestmark = pytest.mark.live


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _line(batch_id: str, line: int) -> LineResult:
    return result_line(OUTPUT, custom_id=f"{batch_id}-{line}")


async def _served_ids(ledger: PostgresShardLedger, store: SegmentFiles, batch_id: str) -> Counter[str]:
    ids: Counter[str] = Counter()
    for kind in (OUTPUT, ERRORS):
        data = b"".join(store.read(await ledger.segments(batch_id, kind)))
        ids.update(json.loads(line)["custom_id"] for line in data.splitlines())
    return ids


async def _wait_finished(ledger: PostgresShardLedger, batch_id: str, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while (work := await ledger.batch(batch_id)) is None or work.status != "finished":
            await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_a_loop_blocked_for_most_of_a_lease_again_and_again_keeps_every_lease(
    postgres_url: str, tmp_path: Path
) -> None:
    """Three times, the loop is blocked for 80% of the lease (more than two renewals' worth); the
    leases are the runner's in the database right after each block, it has lost none, and it is
    healthy. Renewed from the loop, the renewal due during a block would go out after it, too late.
    (The 20% left is room for a loaded machine to hand the renewals over in time: at 90% of a
    1.5 s lease the test failed once in a full run with two busy loops beside it.)"""
    ttl_s = 3.0
    store = SegmentFiles(tmp_path)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_blocked", 400, shard_lines=100)

        async def run_line(batch_id: str, line: int) -> LineResult:
            await asyncio.sleep(0.05)
            return _line(batch_id, line)

        runner = ShardRunner(
            ledger, store, run_line, replica_id="blocked", max_shards=2, concurrency=4, ttl_s=ttl_s
        )
        task = asyncio.create_task(runner.run())
        with anyio.fail_after(30):
            while len(runner.held) < 2:
                await asyncio.sleep(0.01)
        held = runner.held
        for _ in range(3):
            await asyncio.sleep(0.3)  # the loop runs: it takes in what the heartbeat did
            time.sleep(0.8 * ttl_s)
            assert await ledger.holders("batch_blocked") == {runner.owner_id: 2}
            assert runner.held == held
            assert runner.leases_lost == 0 and runner.healthy, runner.problems
        await _wait_finished(ledger, "batch_blocked", 30)
        assert runner.leases_lost == runner.commits_refused == 0 and runner.healthy, runner.problems
        runner.stop()
        await task
        ids = await _served_ids(ledger, store, "batch_blocked")
    assert ids == Counter(f"batch_blocked-{n}" for n in range(400))


@pytest.mark.anyio
async def test_a_loop_blocked_past_its_lease_lets_its_leases_run_out(
    postgres_url: str, tmp_path: Path
) -> None:
    """A loop wedged for twice its lease: its heartbeat stops renewing (it renews only for a loop
    that takes the renewals in), so the database sees the leases run out as a dead replica's;
    the runner drops them when its loop runs again, claims the work anew, and the batch ends with
    each line once."""
    ttl_s = 1.0
    store = SegmentFiles(tmp_path)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_wedged", 200, shard_lines=100)

        async def run_line(batch_id: str, line: int) -> LineResult:
            await asyncio.sleep(0.05)
            return _line(batch_id, line)

        runner = ShardRunner(ledger, store, run_line, replica_id="wedged", max_shards=2, ttl_s=ttl_s)
        task = asyncio.create_task(runner.run())
        with anyio.fail_after(30):
            while len(runner.held) < 2:
                await asyncio.sleep(0.01)
        wedged = runner.held
        time.sleep(2 * ttl_s)
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            cursor = await conn.execute(
                "SELECT shard_no, epoch, lease_expires_at > clock_timestamp() FROM batch_shards "
                "WHERE batch_id = 'batch_wedged' ORDER BY shard_no"
            )
            # each wedged lease ran out (or was claimed again since, at a new epoch)
            after_wedge = [(shard, epoch, live) for shard, epoch, live in await cursor.fetchall()]
        await _wait_finished(ledger, "batch_wedged", 60)
        runner.stop()
        await task
        ids = await _served_ids(ledger, store, "batch_wedged")
    for lease, (shard, epoch, live) in zip(wedged, after_wedge, strict=True):
        assert lease.shard.shard_no == shard and (epoch > lease.epoch or not live)
    assert runner.leases_lost >= 1
    assert ids == Counter(f"batch_wedged-{n}" for n in range(200))


class _CountingBackend(SimulatedBackend):
    """The simulated backend, counting the requests it runs at once (the most, in ``peak``)."""

    def __init__(self, latency_s: float) -> None:
        super().__init__(latency_s=latency_s)
        self.running = 0
        self.peak = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await super().generate(request)
        finally:
            self.running -= 1


@pytest.mark.anyio
async def test_a_replica_runs_thousands_of_lines_at_once_on_a_busy_loop_and_keeps_its_leases(
    postgres_url: str, tmp_path: Path
) -> None:
    """``--max-pool-size``'s default is 10,240: one replica runs thousands of a 30,000-line
    batch's lines at once (it holds the shards to fill its slots), while something else blocks
    its loop for 0.4 s of every 0.6 s. With the default lease (10 s, renewed every third of it)
    every lease holds, it is healthy all along, and the batch completes with every line once. (With
    a 6 s lease, one lease was lost in a full run under coverage with two busy loops beside it:
    a loop that takes in no renewal for a whole lease stops the renewals by design, and one
    ending thousands of lines a turn on so starved a machine can come near that.)"""
    shared = SharedStorage(postgres_url, f"file://{tmp_path / 'shared'}", replica_id="big")
    settings = ServiceSettings(storage_path=tmp_path / "big", shared=shared)
    backend = _CountingBackend(latency_s=0.3)
    lines = 30_000

    async def hog_the_loop() -> None:
        while True:
            await asyncio.sleep(0.2)
            time.sleep(0.4)

    async with BatchService(settings, backend) as service:
        assert service.replica is not None
        runner = service.replica.runner
        file = await service.create_file(jsonl(*(chat_line(f"r{i}") for i in range(lines))))
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        hog = asyncio.create_task(hog_the_loop())
        problems: list[str] = []
        try:
            with anyio.fail_after(120):
                while (ended := await service.get_batch(batch.id)).status is BatchStatus.IN_PROGRESS:
                    problems.extend(runner.problems)
                    await asyncio.sleep(0.1)
        finally:
            hog.cancel()
        assert ended.status is BatchStatus.COMPLETED and ended.request_counts.completed == lines
        assert backend.peak >= 5000, backend.peak
        assert problems == [] and runner.healthy, problems
        assert runner.leases_lost == runner.commits_refused == 0
        assert ended.output_file_id is not None
        content = await service.file_bytes(ended.output_file_id)
        output = b"".join([chunk async for chunk in await content.open(0, content.size)])
    ids = Counter(json.loads(line)["custom_id"] for line in output.splitlines())
    assert ids == Counter(f"r{i}" for i in range(lines))
