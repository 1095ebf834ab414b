"""A shared batch with ``output_order: "input"`` reads in input order once it has ended, never rewritten.

``InputOrder`` over real segment stores (a folder, and SeaweedFS's S3, ``live``): whatever the
layout (several shards, each shard's committed lines in random groups and orders, the shards'
commits interleaved, some lines never committed), the bytes read are the committed lines sorted
by input line number, as long as the segments laid end to end, and any range of them is that
slice of the whole; a range reads only the shards it touches; a segment whose bytes do not split
into the lines its manifest entry lists is refused, not served.

``SharedBatches`` over a real PostgreSQL (two replicas' views, one ledger, one folder), the lines
committed through the ledger in a shuffled order: while the batch runs its files read in commit
order; once it has finished or is cancelled, an input-order batch's output and error files read
in input order, byte for byte the same from either replica and whether or not its ending is
saved yet, with any range a slice of that, the size unchanged; one that ran out of its window
keeps commit order, as in a single process, and so does a completion-order batch; the committed
segments are never touched. Two embedded services end a real batch over several shards in input
order on both.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.batches.shared_batches import EXPIRED_WINDOW, SharedBatches, segment_path
from batchgen.core.execution.shared_storage import SharedStorage
from batchgen.core.files.content import SegmentContent
from batchgen.core.models import OUTPUT_PURPOSE, Batch, FileObject, RequestCounts
from batchgen.core.storage.postgres_metadata import PostgresMetadataStore
from batchgen.core.work.ordered_segments import InputOrder, SegmentLinesMismatch
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.s3_segments import S3Segments
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.segment_store import SegmentMissing, SegmentStore, segment_key
from batchgen.core.work.shards import ERRORS, OUTPUT, Segment, SegmentPart
from tests.examples import examples
from tests.helpers import chat_line, jsonl
from tests.seaweedfs import SeaweedServer

_fresh = itertools.count()
StoreFactory = Callable[[], SegmentStore]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["files", pytest.param("s3", marks=pytest.mark.live)])
def new_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StoreFactory:
    """Makes empty stores of one kind: a folder, or a prefix of a SeaweedFS bucket."""
    if request.param == "files":
        return lambda: SegmentFiles(tmp_path_factory.mktemp("segments"))
    server: SeaweedServer = request.getfixturevalue("seaweed_server")
    return lambda: S3Segments.from_url(server.url(f"order-{time.time_ns()}-{next(_fresh)}"), server.environ)


# --- the layout: any segments of one kind read back in input order ----------------------------

#: A line's bytes (no newline of its own; the store adds one).
_line_bodies = st.binary(max_size=30).map(lambda body: body.replace(b"\n", b" "))


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[list[tuple[int, int]]], dict[int, bytes]]:
    """Shards of consecutive lines, their committed lines in random groups and orders, the groups
    of all shards in one random commit order: (the groups as (shard, line) lists, each line's bytes)."""
    shard_lines = draw(st.integers(1, 9))
    shards = draw(st.integers(1, 5))
    groups: list[list[tuple[int, int]]] = []
    for shard in range(shards):
        lines = list(range(shard * shard_lines, (shard + 1) * shard_lines))
        committed = draw(st.permutations(lines))[: draw(st.integers(0, shard_lines))]
        while committed:
            size = draw(st.integers(1, len(committed)))
            groups.append([(shard, line) for line in committed[:size]])
            committed = committed[size:]
    order = draw(st.permutations(range(len(groups))))
    bodies = {line: draw(_line_bodies) + b"\n" for group in groups for _, line in group}
    return [groups[index] for index in order], bodies


def _write(
    store: SegmentStore, groups: list[list[tuple[int, int]]], bodies: dict[int, bytes]
) -> list[Segment]:
    """Each group as one committed segment, in the order given: the manifest."""
    manifest = []
    for seq, group in enumerate(groups):
        shard = group[0][0]
        key = segment_key("batch_layout", OUTPUT, shard, 1, seq)
        data = b"".join(bodies[line] for _, line in group)
        store.write(key, data)
        lines = tuple(line for _, line in group)
        manifest.append(Segment("batch_layout", OUTPUT, shard, seq, 1, key, len(data), lines))
    return manifest


@settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=examples(60), deadline=None
)
@given(layout=_layouts(), data=st.data())
def test_any_layout_reads_as_its_lines_sorted_and_any_range_is_a_slice(
    new_store: StoreFactory, layout: tuple[list[list[tuple[int, int]]], dict[int, bytes]], data: st.DataObject
) -> None:
    groups, bodies = layout
    store = new_store()
    manifest = _write(store, groups, bodies)
    order = InputOrder.of(manifest)
    whole = b"".join(bodies[line] for line in sorted(bodies))
    assert order.size == store.size(manifest) == len(whole)
    assert b"".join(order.read(store)) == whole
    for _ in range(3):
        start = data.draw(st.integers(0, len(whole)))
        end = data.draw(st.integers(start, len(whole)))
        assert b"".join(order.read(store, start, end)) == whole[start:end]


@pytest.mark.anyio
async def test_segment_content_in_input_order_opens_any_range_as_a_slice(tmp_path: Path) -> None:
    """``SegmentContent`` hands the ordered bytes over, the commit order when not asked for."""
    store = SegmentFiles(tmp_path)
    groups = [[(1, 5), (1, 3)], [(0, 2), (0, 0)], [(1, 4)], [(0, 1)]]
    bodies = {
        line: json.dumps({"custom_id": f"r{line}", "pad": "x" * line}).encode() + b"\n" for line in range(6)
    }
    manifest = _write(store, groups, bodies)
    ordered = SegmentContent.of(store, manifest, in_input_order=True)
    commit_order = SegmentContent.of(store, manifest)
    whole = b"".join(bodies[line] for line in range(6))
    assert ordered.size == commit_order.size == len(whole)
    for start, stop in [(0, len(whole)), (0, 1), (17, 90), (len(whole) - 3, len(whole))]:
        assert b"".join([chunk async for chunk in await ordered.open(start, stop)]) == whole[start:stop]
    read = b"".join([chunk async for chunk in await commit_order.open(0, commit_order.size)])
    assert read == b"".join(bodies[line] for group in groups for _, line in group)


def test_a_range_reads_only_the_shards_it_touches(tmp_path: Path) -> None:
    store = SegmentFiles(tmp_path)
    bodies = {line: f"line {line}\n".encode() for line in range(9)}  # 7 bytes each
    groups = [[(shard, line)] for line in (8, 0, 4, 3, 1, 6, 5, 2, 7) for shard in [line // 3]]
    manifest = _write(store, groups, bodies)
    for segment in manifest:
        if segment.shard_no != 1:
            (tmp_path / segment.object_key).unlink()
    order = InputOrder.of(manifest)
    assert b"".join(order.read(store, 21, 42)) == b"line 3\nline 4\nline 5\n"  # shard 1 alone
    assert b"".join(order.read(store, 23, 30)) == b"ne 3\nli"
    with pytest.raises(SegmentMissing):
        b"".join(order.read(store, 20, 42))  # the last byte of shard 0


@pytest.mark.parametrize("data", [b"one\ntwo\n", b"one\ntwo\nthree", b"one\n"])
def test_a_segment_that_does_not_hold_its_listed_lines_is_refused(tmp_path: Path, data: bytes) -> None:
    store = SegmentFiles(tmp_path)
    key = segment_key("batch_bad", ERRORS, 0, 1, 0)
    store.write(key, data)
    manifest = [Segment("batch_bad", ERRORS, 0, 0, 1, key, len(data), (1, 0, 2))]
    with pytest.raises(SegmentLinesMismatch, match="manifest lists 3"):
        b"".join(InputOrder.of(manifest).read(store))


# --- SharedBatches: when a shared batch's files read in input order --------------------------


@pytest.fixture
async def ledger(postgres_url: str) -> AsyncIterator[PostgresShardLedger]:
    async with PostgresShardLedger(postgres_url) as opened:
        await opened.create_schema()
        yield opened


def _new_batch(batch_id: str, lines: int, output_order: str) -> Batch:
    created = int(time.time())
    return Batch(
        id=batch_id,
        endpoint="/v1/chat/completions",
        input_file_id="file-input",
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=created,
        expires_at=created + 86_400,
        model="default",
        request_counts=RequestCounts(total=lines),
        output_order=output_order,
    )


def _line(batch_id: str, line: int) -> tuple[str, bytes]:
    """Line ``line``'s kind and bytes: an error line for every seventh."""
    kind = ERRORS if line % 7 == 0 else OUTPUT
    return kind, (json.dumps({"custom_id": f"{batch_id}-{line}", "kind": kind}) + "\n").encode()


async def _commit_shuffled(
    ledger: PostgresShardLedger, store: SegmentStore, batch_id: str, rng: random.Random, share: float
) -> set[int]:
    """Commit ``share`` of each shard's lines, in random groups, the shards' commits interleaved
    (as replicas would): the lines committed."""
    pending = []
    for lease in await ledger.claim("writer", 100, 60.0):
        lines = list(lease.shard.lines)
        rng.shuffle(lines)
        lines = lines[: round(len(lines) * share)]
        while lines:
            size = rng.randint(1, 60)
            pending.append((lease, lines[:size]))
            lines = lines[size:]
    rng.shuffle(pending)
    numbers = itertools.count()
    for lease, lines in pending:
        parts = []
        for kind in (OUTPUT, ERRORS):
            mine = sorted(line for line in lines if _line(batch_id, line)[0] == kind)
            if mine:
                key = segment_key(batch_id, kind, lease.shard.shard_no, lease.epoch, next(numbers))
                size = store.write(key, b"".join(_line(batch_id, line)[1] for line in mine))
                failed_lines = len(mine) if kind == ERRORS else 0
                parts.append(SegmentPart(kind, key, size, tuple(mine), failed_lines=failed_lines))
        await ledger.commit(lease, parts)
    return {line for _, lines in pending for line in lines}


def _result_file(batch_id: str, kind: str) -> FileObject:
    """A record naming the batch's segments of ``kind``, as the replicas make it."""
    return FileObject(f"file-{kind}", 0, 0, f"{kind}.jsonl", OUTPUT_PURPOSE, segment_path(batch_id, kind))


async def _read(
    view: SharedBatches, batch_id: str, kind: str, start: int = 0, stop: int | None = None
) -> bytes:
    content = await view.content(_result_file(batch_id, kind))
    assert content is not None
    stop = content.size if stop is None else stop
    return b"".join([chunk async for chunk in await content.open(start, stop)])


def _in_input_order(batch_id: str, kind: str, lines: set[int]) -> bytes:
    return b"".join(_line(batch_id, line)[1] for line in sorted(lines) if _line(batch_id, line)[0] == kind)


def _digests(store: SegmentFiles) -> dict[str, str]:
    """Every segment object's hash, whether committed or not."""
    written = list(store.keys())
    return {key: hashlib.sha256((store.root / key).read_bytes()).hexdigest() for key in written}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("output_order", "ending", "status", "in_input_order"),
    [
        ("input", "finished", BatchStatus.COMPLETED, True),
        ("input", "cancelled", BatchStatus.CANCELLED, True),
        ("input", EXPIRED_WINDOW, BatchStatus.EXPIRED, False),
        ("completion", "finished", BatchStatus.COMPLETED, False),
        ("completion", "cancelled", BatchStatus.CANCELLED, False),
    ],
)
async def test_a_shared_batch_reads_in_input_order_once_it_ended_as_a_single_process_would(
    postgres_url: str,
    ledger: PostgresShardLedger,
    tmp_path: Path,
    output_order: str,
    ending: str,
    status: BatchStatus,
    in_input_order: bool,
) -> None:
    store = SegmentFiles(tmp_path)
    metadata = [PostgresMetadataStore(postgres_url), PostgresMetadataStore(postgres_url)]
    views = [SharedBatches(each, ledger, store, openai_convention=True) for each in metadata]
    rng = random.Random(f"{output_order}/{ending}")
    try:
        batch = await views[0].share(_new_batch("batch_order", 1300, output_order))  # 3 shards
        committed = await _commit_shuffled(ledger, store, batch.id, rng, 1.0 if ending == "finished" else 0.6)
        commit_order = {
            kind: b"".join(store.read(await ledger.segments(batch.id, kind))) for kind in (OUTPUT, ERRORS)
        }
        for kind in (OUTPUT, ERRORS):  # running: commit order, whatever was asked
            assert commit_order[kind] != _in_input_order(batch.id, kind, committed)
            assert await _read(views[1], batch.id, kind) == commit_order[kind]
        untouched = _digests(store)

        if ending == "finished":
            assert await ledger.finish_if_done(batch.id)
        else:
            assert await ledger.cancel(batch.id, ending)
        expected = {
            kind: _in_input_order(batch.id, kind, committed) if in_input_order else commit_order[kind]
            for kind in (OUTPUT, ERRORS)
        }
        for view in views:  # ended in the ledger, before any replica has saved the ending
            for kind in (OUTPUT, ERRORS):
                assert await _read(view, batch.id, kind) == expected[kind]

        recorded = metadata[1].get_batch(batch.id)
        assert recorded is not None
        ended = [await view.view(recorded) for view in views]
        assert ended[0] == ended[1] and ended[0].status is status
        assert ended[0].output_order == output_order == metadata[0].get_batch(batch.id).output_order  # type: ignore[union-attr]
        output = metadata[0].get_file(ended[0].output_file_id or "")
        assert output is not None
        for view in views:
            assert (await view.sized(output)).bytes == len(expected[OUTPUT]) == len(commit_order[OUTPUT])
            for kind in (OUTPUT, ERRORS):
                whole = expected[kind]
                assert await _read(view, batch.id, kind) == whole
                for _ in range(5):
                    start = rng.randrange(len(whole))
                    stop = rng.randint(start + 1, len(whole))
                    assert await _read(view, batch.id, kind, start, stop) == whole[start:stop]
        if in_input_order:
            ids = [
                json.loads(line)["custom_id"]
                for line in (await _read(views[0], batch.id, OUTPUT)).splitlines()
            ]
            assert ids == sorted(ids, key=lambda custom_id: int(custom_id.rsplit("-", 1)[1]))
        assert _digests(store) == untouched  # nothing committed was rewritten, nothing added
    finally:
        for each in metadata:
            each.close()


# --- two embedded replicas end a real batch in input order ----------------------------------


@pytest.fixture
async def replicas(postgres_url: str, tmp_path: Path) -> AsyncIterator[list[BatchService]]:
    """Two services sharing one database and folder, ``--output-order input`` their default."""
    async with AsyncExitStack() as stack:
        services = []
        for name in ("a", "b"):
            shared = SharedStorage(
                postgres_url, f"file://{tmp_path / 'shared'}", replica_id=name, lease_s=3.0
            )
            settings_ = ServiceSettings(storage_path=tmp_path / name, shared=shared, output_order="input")
            service = BatchService(settings_, SimulatedBackend(latency_s=0.002, token_latency_s=0.03))
            services.append(await stack.enter_async_context(service))
        yield services


async def _download(service: BatchService, file_id: str, start: int = 0, stop: int | None = None) -> bytes:
    content = await service.file_bytes(file_id)
    stop = content.size if stop is None else stop
    return b"".join([chunk async for chunk in await content.open(start, stop)])


@pytest.mark.anyio
async def test_two_replicas_end_a_batch_in_input_order_and_serve_the_same_bytes(
    replicas: list[BatchService],
) -> None:
    first, second = replicas
    # each later line shorter: with a latency per token the last shard's lines are committed first
    # (the first lines take up to 1.4 s, the last 0.03 s: far apart even on a loaded machine)
    lines = [chat_line(f"r{i}", f"question {i}", max_tokens=1 + (1299 - i) * 40 // 1300) for i in range(1300)]
    files = [await first.create_file(jsonl(*lines)) for _ in range(2)]
    ordered = await first.create_batch(files[0].id, "/v1/chat/completions")  # the replicas' default
    as_finished = await second.create_batch(files[1].id, "/v1/chat/completions", output_order="completion")
    with anyio.fail_after(120):
        ended = [await second.wait_for_batch(ordered.id, poll_interval=0.1)]
        ended.append(await first.wait_for_batch(as_finished.id, poll_interval=0.1))
    assert [batch.status for batch in ended] == [BatchStatus.COMPLETED] * 2
    assert [batch.output_order for batch in ended] == ["input", "completion"]
    assert await first.get_batch(ordered.id) == ended[0]
    output_id = ended[0].output_file_id or ""
    output = await _download(first, output_id)
    assert output == await _download(second, output_id)
    assert [json.loads(line)["custom_id"] for line in output.splitlines()] == [f"r{i}" for i in range(1300)]
    for service in replicas:
        assert (await service.get_file(output_id)).bytes == len(output)
        assert await _download(service, output_id, 1000, 250_000) == output[1000:250_000]
    assert first.replica is not None
    ledger, store = first.replica.ledger, first.replica.segments
    assert b"".join(store.read(await ledger.segments(ordered.id, OUTPUT))) != output  # as committed
    unordered = b"".join(store.read(await ledger.segments(as_finished.id, OUTPUT)))
    assert await _download(second, ended[1].output_file_id or "") == unordered
