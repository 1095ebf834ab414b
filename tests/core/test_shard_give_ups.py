"""A cause that makes a replica give up shard after shard is logged once, then counted.

With a wrong blob prefix a replica once could not read any input and logged a traceback per line
("Task exception was never retrieved", 174 MB in 90 s). Here every line fails the same way (the
``run_line`` of a replica that cannot read its inputs), on a real PostgreSQL: the runner gives up
its shards again and again, and the log holds that cause's traceback once, its later times as
counts, and no unretrieved task exception at all.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path

import pytest

from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.shard_runner import GIVE_UP_LOG_EVERY_S, LineResult, ShardRunner

pytestmark = pytest.mark.live


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_cause_repeated_over_many_shards_and_lines_is_one_traceback_and_a_count(
    postgres_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def run_line(batch_id: str, line: int) -> LineResult:
        await asyncio.sleep(0)
        raise FileNotFoundError(f"input of {batch_id} is not in the blob store")

    caplog.set_level(logging.INFO)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_unreadable", 2000, 100)
        runner = ShardRunner(ledger, SegmentFiles(tmp_path), run_line, replica_id="stray", max_shards=4)
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 120
        while sum(runner.give_ups.values()) < 20:
            assert time.monotonic() < deadline, runner.give_ups
            await asyncio.sleep(0.05)
        runner.stop()
        await task
    gc.collect()  # a task whose exception nobody read is reported when it is collected
    [cause] = runner.give_ups
    assert "FileNotFoundError" in cause and "batch_unreadable" in cause
    tracebacks = [r for r in caplog.records if r.exc_info and "gives up shard" in r.getMessage()]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    counted = [r for r in caplog.records if "gave up shards" in r.getMessage()]
    assert len(counted) <= 1 + (time.monotonic() - deadline + 120) / GIVE_UP_LOG_EVERY_S
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
