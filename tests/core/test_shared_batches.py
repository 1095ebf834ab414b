"""Batches shared by replicas end the same on every replica, on a real PostgreSQL.

``SharedBatches`` over two metadata stores (two replicas) and one ledger: a shared batch runs
through ``ShardRunner`` and both replicas, looking at once, end it with exactly the same record,
its counts the committed lines and its times the ledger's; a cancel on one replica ends it
``cancelled`` on both with the lines committed by then; error lines kept apart get one error file
however many replicas end the batch together, and error lines kept with the output count as
failed, as in one process; a batch over the global intake records nothing; a record that fails
leaves no work running. The paths naming a batch's segments are read back as they were made, for
any batch id.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.batches.shared_batches import SharedBatches, result_file_id, segment_path, segments_of
from batchgen.core.models import Batch, BatchStatus, RequestCounts
from batchgen.core.requests.line_outcomes import LineOutcome, line_outcome
from batchgen.core.requests.results import error_line
from batchgen.core.storage.postgres_metadata import PostgresMetadataStore
from batchgen.core.work.intake import IntakeFull, IntakeLimits
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.shard_runner import LineResult, ShardRunner
from batchgen.core.work.shards import ERRORS, OUTPUT
from tests.work_replica import result_line


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _new_batch(batch_id: str, lines: int, owner: str = "default") -> Batch:
    return Batch(
        id=batch_id,
        endpoint="/v1/chat/completions",
        input_file_id="file-input",
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=1_700_000_000,
        expires_at=1_700_086_400,
        model="default",
        request_counts=RequestCounts(total=lines),
        owner=owner,
    )


class _Replicas:
    """Two replicas' views over one database, one ledger and one segment folder."""

    def __init__(
        self, url: str, ledger: PostgresShardLedger, segments: SegmentFiles, **options: object
    ) -> None:
        self.stores = [PostgresMetadataStore(url), PostgresMetadataStore(url)]
        self.views = [SharedBatches(store, ledger, segments, **options) for store in self.stores]  # type: ignore[arg-type]

    def close(self) -> None:
        for store in self.stores:
            store.close()


@pytest.fixture
async def ledger(postgres_url: str) -> AsyncIterator[PostgresShardLedger]:
    async with PostgresShardLedger(postgres_url) as opened:
        await opened.create_schema()
        yield opened


def _runner(ledger: PostgresShardLedger, segments: SegmentFiles, line_s: float = 0.0) -> ShardRunner:
    async def run_line(batch_id: str, line: int) -> LineResult:
        await asyncio.sleep(line_s)
        kind = ERRORS if line % 7 == 0 else OUTPUT
        return result_line(kind, custom_id=f"{batch_id}-{line}")

    return ShardRunner(ledger, segments, run_line, replica_id="runner", commit_interval_s=0.05, poll_s=0.05)


async def _until_committed(ledger: PostgresShardLedger, batch_id: str, lines: int) -> None:
    with anyio.fail_after(30):
        while (work := await ledger.batch(batch_id)) is None or work.completed + work.failed < lines:
            await asyncio.sleep(0.05)


async def _committed_lines(ledger: PostgresShardLedger, segments: SegmentFiles, batch_id: str) -> int:
    """How many output and error lines of the batch a reader gets."""
    committed = 0
    for kind in (OUTPUT, ERRORS):
        committed += len(b"".join(segments.read(await ledger.segments(batch_id, kind))).splitlines())
    return committed


async def _until_ended(view: SharedBatches, batch: Batch) -> Batch:
    with anyio.fail_after(30):
        while not (batch := await view.view(batch)).status.is_terminal:
            await asyncio.sleep(0.05)
    return batch


@pytest.mark.anyio
async def test_every_replica_ends_a_finished_batch_with_the_same_record(
    postgres_url: str, ledger: PostgresShardLedger, tmp_path: Path
) -> None:
    segments = SegmentFiles(tmp_path)
    replicas = _Replicas(postgres_url, ledger, segments)
    runner = _runner(ledger, segments)
    try:
        batch = await replicas.views[0].share(_new_batch("batch_same", 300))
        assert batch.status is BatchStatus.IN_PROGRESS and batch.output_file_id == result_file_id(
            batch.id, OUTPUT
        )
        running = await replicas.views[1].view(replicas.stores[1].get_batch(batch.id))  # type: ignore[arg-type]
        assert running.status is BatchStatus.IN_PROGRESS
        task = asyncio.create_task(runner.run())
        with anyio.fail_after(30):
            while (work := await ledger.batch(batch.id)) is None or work.status != "finished":
                await asyncio.sleep(0.05)
        recorded = replicas.stores[0].get_batch(batch.id)
        assert recorded is not None and recorded.status is BatchStatus.IN_PROGRESS  # nobody looked yet
        await asyncio.sleep(1.1)  # a replica's clock moves on; the ending's times must not
        seen = await asyncio.gather(*(view.view(recorded) for view in replicas.views))
        runner.stop()
        await task
        assert seen[0] == seen[1]
        ended = seen[0]
        assert ended.status is BatchStatus.COMPLETED
        assert work.ended_at is not None and ended.completed_at == ended.finalizing_at == int(work.ended_at)
        assert (ended.request_counts.completed, ended.request_counts.failed) == (257, 43)
        assert ended.error_file_id is None  # the error lines are with the output
        for store in replicas.stores:
            assert store.get_batch(batch.id) == ended
        output = replicas.stores[1].get_file(ended.output_file_id or "")
        assert output is not None and segments_of(output.path) == (batch.id, OUTPUT)
        committed = segments.size(await ledger.segments(batch.id, OUTPUT))
        assert committed > 0 and (await replicas.views[1].sized(output)).bytes == committed
        content = await replicas.views[1].content(output)
        assert content is not None and content.size == committed
        tail = b"".join([chunk async for chunk in await content.open(committed - 100, committed)])
        whole = b"".join(segments.read(await ledger.segments(batch.id, OUTPUT)))
        assert tail == whole[-100:] and tail.endswith(b"\n")
        assert await replicas.views[1].view(ended) is ended  # an ended batch is final
    finally:
        replicas.close()


@pytest.mark.anyio
async def test_a_cancel_on_one_replica_ends_the_batch_cancelled_on_both(
    postgres_url: str, ledger: PostgresShardLedger, tmp_path: Path
) -> None:
    segments = SegmentFiles(tmp_path)
    replicas = _Replicas(postgres_url, ledger, segments)
    runner = _runner(ledger, segments, line_s=0.01)
    try:
        batch = await replicas.views[0].share(_new_batch("batch_cancel", 2000))
        task = asyncio.create_task(runner.run())
        await _until_committed(ledger, batch.id, 50)
        cancelled = await replicas.views[1].cancel(batch)
        await asyncio.sleep(1.0)  # the runner drops the batch's shards; nothing commits after the cancel
        runner.stop()
        await task
        other = await replicas.views[0].view(batch)
        assert cancelled == other and cancelled.status is BatchStatus.CANCELLED
        assert cancelled.cancelling_at == cancelled.cancelled_at
        counts = cancelled.request_counts
        committed = await _committed_lines(ledger, segments, batch.id)
        assert 50 <= counts.completed + counts.failed == committed < 2000
    finally:
        replicas.close()


@pytest.mark.anyio
async def test_error_lines_kept_with_the_output_count_as_failed_on_every_replica(
    postgres_url: str, ledger: PostgresShardLedger, tmp_path: Path
) -> None:
    """The user guide's convention: error lines go to the output segments with the results, and
    count as failed all the same, as one process counts them (by what each line records)."""
    segments = SegmentFiles(tmp_path)
    replicas = _Replicas(postgres_url, ledger, segments)
    failing = {line for line in range(300) if line % 3 == 0 or line % 11 == 0}

    async def run_line(batch_id: str, line: int) -> LineResult:
        if line in failing:  # as the line runner makes it: in the output, the guide's way
            return LineResult(OUTPUT, error_line(f"{batch_id}-{line}", "context_length_exceeded", "too long"))
        return result_line(OUTPUT, custom_id=f"{batch_id}-{line}")

    runner = ShardRunner(ledger, segments, run_line, replica_id="runner", commit_interval_s=0.05, poll_s=0.05)
    try:
        batch = await replicas.views[0].share(_new_batch("batch_mixed", 300))
        task = asyncio.create_task(runner.run())
        ended = await asyncio.gather(*(_until_ended(view, batch) for view in replicas.views))
        runner.stop()
        await task
        assert ended[0] == ended[1] and ended[0].status is BatchStatus.COMPLETED
        output = b"".join(segments.read(await ledger.segments(batch.id, OUTPUT))).splitlines()
        recorded = Counter(line_outcome(line) for line in output)
        counts = ended[0].request_counts
        assert (counts.completed, counts.failed) == (300 - len(failing), len(failing))
        assert (counts.completed, counts.failed) == (
            recorded[LineOutcome.COMPLETED],
            recorded[LineOutcome.FAILED],
        )
        assert ended[0].error_file_id is None
    finally:
        replicas.close()


@pytest.mark.parametrize("ending", ["completed", "cancelled", "expired"])
@pytest.mark.anyio
async def test_error_lines_kept_apart_get_one_error_file_however_the_batch_ends_and_whoever_ends_it(
    postgres_url: str, ledger: PostgresShardLedger, tmp_path: Path, ending: str
) -> None:
    """As in one process, a batch with error lines kept apart has its error file whether it
    completed, was cancelled or ran out of its window."""
    segments = SegmentFiles(tmp_path)
    replicas = _Replicas(postgres_url, ledger, segments, openai_convention=True)
    runner = _runner(ledger, segments, line_s=0.0 if ending == "completed" else 0.01)
    try:
        lines = 100 if ending == "completed" else 2000
        batch = await replicas.views[0].share(_new_batch(f"batch_errors_{ending}", lines))
        task = asyncio.create_task(runner.run())
        if ending != "completed":
            await _until_committed(ledger, batch.id, 50)
            if ending == "cancelled":
                await replicas.views[1].cancel(batch)
            else:  # its window is long past
                await replicas.views[1].end_due()
        ended = await asyncio.gather(*(_until_ended(view, batch) for view in replicas.views))
        runner.stop()
        await task
        assert ended[0] == ended[1] and ended[0].status.value == ending
        assert ended[0].error_file_id == result_file_id(batch.id, ERRORS)
        files, _ = replicas.stores[0].list_files(after=None, limit=100, descending=False, purpose=None)
        assert sorted(file.id for file in files) == sorted(
            [result_file_id(batch.id, kind) for kind in (OUTPUT, ERRORS)]
        )
    finally:
        replicas.close()


@pytest.mark.anyio
async def test_a_batch_over_the_global_intake_records_nothing(
    postgres_url: str, ledger: PostgresShardLedger, tmp_path: Path
) -> None:
    replicas = _Replicas(postgres_url, ledger, SegmentFiles(tmp_path), limits=IntakeLimits(capacity=100))
    try:
        await replicas.views[0].share(_new_batch("batch_fits", 60))
        with pytest.raises(IntakeFull):
            await replicas.views[1].share(_new_batch("batch_over", 41))
        assert replicas.stores[0].get_batch("batch_over") is None
        assert await ledger.batch("batch_over") is None
        assert replicas.stores[0].get_batch("batch_fits") is not None
    finally:
        replicas.close()


@pytest.mark.anyio
async def test_a_record_that_fails_leaves_no_work_running(
    postgres_url: str, ledger: PostgresShardLedger, tmp_path: Path
) -> None:
    store = PostgresMetadataStore(postgres_url)

    class _Full(PostgresMetadataStore):
        def insert_batch(self, *args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

    failing = _Full(postgres_url)
    try:
        with pytest.raises(OSError):
            await SharedBatches(failing, ledger, SegmentFiles(tmp_path)).share(_new_batch("batch_lost", 10))
        work = await ledger.batch("batch_lost")
        assert work is not None and work.status == "cancelled"
        assert store.get_batch("batch_lost") is None
    finally:
        failing.close()
        store.close()


@given(
    st.text(st.characters(exclude_characters="/", exclude_categories=["Cs"]), min_size=1),
    st.sampled_from([OUTPUT, ERRORS]),
)
def test_a_segment_path_names_its_batch_and_kind(batch_id: str, kind: str) -> None:
    assert segments_of(segment_path(batch_id, kind)) == (batch_id, kind)
    assert segments_of(f"/var/lib/batchgen/{batch_id}") is None
    assert result_file_id(batch_id, kind) != result_file_id(batch_id + "x", kind)


@pytest.mark.parametrize(("openai", "status"), [(False, BatchStatus.FAILED), (True, BatchStatus.EXPIRED)])
@pytest.mark.anyio
async def test_a_batch_past_its_window_ends_the_same_on_every_replica_with_its_lines_kept(
    postgres_url: str, ledger: PostgresShardLedger, tmp_path: Path, openai: bool, status: BatchStatus
) -> None:
    segments = SegmentFiles(tmp_path)
    replicas = _Replicas(postgres_url, ledger, segments, openai_convention=openai)
    runner = _runner(ledger, segments, line_s=0.01)
    try:
        late = await replicas.views[0].share(_new_batch(f"batch_late_{openai}", 2000))  # its window is past
        task = asyncio.create_task(runner.run())
        await _until_committed(ledger, late.id, 50)
        await asyncio.gather(*(view.end_due() for view in replicas.views))
        await asyncio.sleep(1.0)
        runner.stop()
        await task
        ended = [await view.view(late) for view in replicas.views]
        assert ended[0] == ended[1] and ended[0].status is status
        counts = ended[0].request_counts
        committed = await _committed_lines(ledger, segments, late.id)
        assert 50 <= counts.completed + counts.failed == committed < 2000
        if not openai:
            assert ended[0].error is not None and ended[0].error.code == "batch_failed"
            assert "timed out" in ended[0].error.message and f"{committed} of 2000" in ended[0].error.message
        cancelled_first = await replicas.views[1].share(_new_batch(f"batch_both_{openai}", 10))
        await replicas.views[1].cancel(cancelled_first)  # then its window runs out too: it stays cancelled
        await replicas.views[0].end_due()
        assert (await replicas.views[0].view(cancelled_first)).status is BatchStatus.CANCELLED
    finally:
        replicas.close()
