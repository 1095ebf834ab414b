"""Two embedded services sharing one PostgreSQL and one folder serve any call for any batch.

``BatchService`` with ``ServiceSettings.shared``: a file uploaded to one replica and a batch
created on it are run by both (each claims shards), polled on the other to ``completed``, and its
output read through either replica is every request's line exactly once; a batch created on one
is cancelled from the other, and ends ``cancelled`` on both with the lines committed by then; an
Idempotency-Key repeated on the other replica returns the same batch; a batch past the shared
intake is refused with 429's error and nothing recorded, and a tenant's limits on running batches
and queued requests hold across replicas. Neither replica resumes anything on its
own at start: a third replica started later takes shards of the running batch. A replica deletes
the segments no commit lists once they are past the grace period, and only those; deleting a
shared result file deletes its uncommitted segments at once too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import IntakeFull, InvalidRequest, ServiceUnavailable, StorageUnavailable
from batchgen.core.execution.shared_storage import SharedStorage
from batchgen.core.models import Batch, GenerationRequest, GenerationResult
from batchgen.core.tenancy import Caller, TenantLimits
from tests.helpers import chat_line, jsonl


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _settings(tmp_path: Path, url: str, replica: str, **options: object) -> ServiceSettings:
    shared = SharedStorage(url, f"file://{tmp_path / 'shared'}", replica_id=replica, lease_s=3.0)
    return ServiceSettings(storage_path=tmp_path / replica, shared=shared, **options)  # type: ignore[arg-type]


@pytest.fixture
async def replicas(postgres_url: str, tmp_path: Path) -> AsyncIterator[list[BatchService]]:
    async with AsyncExitStack() as stack:
        services = []
        for replica in ("a", "b"):
            backend = SimulatedBackend(latency_s=0.003)
            # 256 lines at once each, so both share these batches: at the default (10,240) one
            # replica holds every shard of them (tests/core/test_lease_heartbeat.py runs one so)
            settings = _settings(tmp_path, postgres_url, replica, max_pool_size=256)
            services.append(await stack.enter_async_context(BatchService(settings, backend)))
        yield services


async def _read(service: BatchService, file_id: str) -> bytes:
    content = await service.file_bytes(file_id)
    return b"".join([chunk async for chunk in await content.open(0, content.size)])


@pytest.mark.anyio
async def test_a_batch_created_on_one_replica_runs_on_both_and_reads_the_same_on_either(
    replicas: list[BatchService],
) -> None:
    first, second = replicas
    file = await first.create_file(jsonl(*(chat_line(f"r{i}", f"question {i}") for i in range(3000))))
    batch = await first.create_batch(file.id, "/v1/chat/completions")
    assert batch.status is BatchStatus.IN_PROGRESS
    with anyio.fail_after(60):
        ended = await second.wait_for_batch(batch.id, poll_interval=0.1)
    assert ended.status is BatchStatus.COMPLETED and ended.request_counts.completed == 3000
    assert await first.get_batch(batch.id) == ended
    assert ended.output_file_id is not None
    output = await _read(second, ended.output_file_id)
    assert output == await _read(first, ended.output_file_id)
    lines = [json.loads(line) for line in output.splitlines()]
    assert Counter(line["custom_id"] for line in lines) == Counter(f"r{i}" for i in range(3000))
    assert (await second.get_file(ended.output_file_id)).bytes == len(output)
    assert all(
        service.replica is not None and service.replica.runner.lines_committed > 0 for service in replicas
    )
    with pytest.raises(InvalidRequest, match="file_bytes"):
        await first.file_content(ended.output_file_id)
    listed, _ = await second.list_batches()
    assert [item.id for item in listed] == [batch.id] and listed[0] == ended


@pytest.mark.anyio
async def test_a_batch_cancelled_on_the_other_replica_ends_cancelled_on_both(
    replicas: list[BatchService],
) -> None:
    first, second = replicas
    file = await first.create_file(jsonl(*(chat_line(f"r{i}") for i in range(20_000))))
    batch = await first.create_batch(file.id, "/v1/chat/completions")
    with anyio.fail_after(30):
        while (await second.get_batch(batch.id)).request_counts.completed < 100:
            await anyio.sleep(0.05)
    cancelled = await second.cancel_batch(batch.id)
    assert cancelled.status is BatchStatus.CANCELLED
    await anyio.sleep(1.0)  # the replicas drop the batch's shards; nothing commits after it ended
    assert await first.get_batch(batch.id) == cancelled
    # cancelling it again, on either replica, returns it as it is
    assert await first.cancel_batch(batch.id) == cancelled == await second.cancel_batch(batch.id)
    assert cancelled.output_file_id is not None
    committed = (await _read(first, cancelled.output_file_id)).splitlines()
    assert 100 <= len(committed) == cancelled.request_counts.completed < 20_000


@pytest.mark.anyio
async def test_an_idempotency_key_repeated_on_the_other_replica_returns_the_same_batch(
    replicas: list[BatchService],
) -> None:
    first, second = replicas
    file = await first.create_file(jsonl(chat_line("only")))
    batch = await first.create_batch(file.id, "/v1/chat/completions", idempotency_key="key-1")
    again = await second.create_batch(file.id, "/v1/chat/completions", idempotency_key="key-1")
    assert again.id == batch.id


@pytest.mark.anyio
async def test_a_batch_past_the_shared_intake_is_refused_and_nothing_is_recorded(
    postgres_url: str, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, postgres_url, "small", max_intake_capacity=100)
    async with BatchService(settings, SimulatedBackend(latency_s=1.0)) as service:
        fits = await service.create_file(jsonl(*(chat_line(f"r{i}") for i in range(80))))
        await service.create_batch(fits.id, "/v1/chat/completions")
        over = await service.create_file(jsonl(*(chat_line(f"s{i}") for i in range(30))))
        with pytest.raises(IntakeFull) as refused:
            await service.create_batch(over.id, "/v1/chat/completions")
        assert refused.value.retry_after_s > 0 and "80 unfinished requests" in str(refused.value)
        listed, _ = await service.list_batches()
        assert len(listed) == 1


@pytest.mark.anyio
async def test_a_replica_started_later_takes_shards_of_a_running_batch(
    postgres_url: str, tmp_path: Path
) -> None:
    late_started = anyio.Event()
    # the early replica holds two shards (256 lines at once) and runs nothing of them until the
    # late one has started, so the batch cannot end first however slow the machine is
    async with BatchService(
        _settings(tmp_path, postgres_url, "early", max_pool_size=256), _HeldBackend(late_started)
    ) as early:
        file = await early.create_file(jsonl(*(chat_line(f"r{i}") for i in range(4000))))
        batch = await early.create_batch(file.id, "/v1/chat/completions")
        async with BatchService(
            _settings(tmp_path, postgres_url, "late"), SimulatedBackend(latency_s=0.01)
        ) as late:
            late_started.set()
            with anyio.fail_after(120):
                ended = await late.wait_for_batch(batch.id, poll_interval=0.1)
            assert late.replica is not None and late.replica.runner.lines_committed > 0
    assert ended.status is BatchStatus.COMPLETED and ended.request_counts.completed == 4000


class _HeldBackend(SimulatedBackend):
    """The simulated backend, answering nothing until ``go`` is set."""

    def __init__(self, go: anyio.Event) -> None:
        super().__init__(latency_s=0.01)
        self.go = go

    async def _result(self, request: GenerationRequest) -> GenerationResult:
        await self.go.wait()
        return await super()._result(request)


async def _create_batch(service: BatchService, file_id: str, caller: Caller) -> Batch:
    """``create_batch``, called again while it answers 503 (ServiceUnavailable: a claim of the
    shared work that timed out on a loaded machine leaves the replica unhealthy until the next
    one is answered; StorageUnavailable: no database connection in time), as docs/api.md tells
    a client to, for up to a minute."""
    with anyio.fail_after(60):
        while True:
            try:
                return await service.create_batch(file_id, "/v1/chat/completions", caller=caller)
            except (ServiceUnavailable, StorageUnavailable):
                await anyio.sleep(0.1)


@pytest.mark.anyio
async def test_a_tenants_limits_hold_across_replicas(replicas: list[BatchService]) -> None:
    first, second = replicas
    slow = Caller("alpha", limits=TenantLimits(max_active_batches=1, max_queued_requests=50_000))
    big = await first.create_file(jsonl(*(chat_line(f"r{i}") for i in range(40_000))), caller=slow)
    await _create_batch(first, big.id, slow)
    small = await second.create_file(jsonl(chat_line("one")), caller=slow)
    with pytest.raises(IntakeFull, match="running batches"):
        await _create_batch(second, small.id, slow)
    queued = Caller("beta", limits=TenantLimits(max_queued_requests=41_000))
    files = [
        await first.create_file(jsonl(*(chat_line(f"{n}-{i}") for i in range(lines))), caller=queued)
        for n, lines in enumerate((40_000, 10_000))
    ]
    await _create_batch(second, files[0].id, queued)
    with pytest.raises(IntakeFull, match=r"tenant 'beta' has [0-9]+ unfinished requests of its 41000"):
        await _create_batch(first, files[1].id, queued)


@pytest.mark.anyio
async def test_a_replica_deletes_the_segments_no_commit_lists_and_keeps_the_committed(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a dead or fenced-out replica wrote and never committed is collected: a replica
    sweeps the store (here every 0.2 s, for segments older than 0.5 s) and deletes exactly the
    objects of its batches that the manifest does not list; a segment of a batch its database
    does not know (another cluster's) stays."""
    from batchgen.core.execution import replica_work

    monkeypatch.setattr(replica_work, "COLLECT_EVERY_S", 0.2)
    monkeypatch.setattr(replica_work, "ORPHAN_GRACE_S", 0.5)
    segments = tmp_path / "shared" / "segments"
    stranger = segments / "batch_unknown_here" / "output" / "0" / "1-0.jsonl"
    stranger.parent.mkdir(parents=True)
    stranger.write_bytes(b'{"custom_id": "not this database\'s"}\n')
    settings = _settings(tmp_path, postgres_url, "a")
    async with BatchService(settings, SimulatedBackend(latency_s=0.001)) as service:
        file = await service.create_file(jsonl(*(chat_line(f"r{i}") for i in range(600))))
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        orphan = segments / batch.id / "output" / "0" / "999-0.jsonl"  # an epoch no commit has
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b'{"custom_id": "never committed"}\n')
        with anyio.fail_after(60):
            ended = await service.wait_for_batch(batch.id, poll_interval=0.1)
            assert service.replica is not None
            while orphan.exists():
                await anyio.sleep(0.1)
        assert service.replica.orphans_collected >= 1
        assert stranger.exists()
        assert ended.output_file_id is not None
        output = await _read(service, ended.output_file_id)  # the committed segments are all there
        assert len(output.splitlines()) == 600


@pytest.mark.anyio
async def test_deleting_a_shared_result_file_deletes_its_uncommitted_segments_too(
    replicas: list[BatchService], tmp_path: Path
) -> None:
    """A fenced-out writer's segment (its commit refused) under a batch's output is none of the
    manifest's, but it holds the batch's lines: deleting the output file deletes it at once too,
    not an orphan sweep an hour later, and leaves the batch's error segments alone."""
    first, second = replicas
    file = await first.create_file(jsonl(*(chat_line(f"r{i}") for i in range(300))))
    batch = await first.create_batch(file.id, "/v1/chat/completions")
    with anyio.fail_after(60):
        ended = await second.wait_for_batch(batch.id, poll_interval=0.1)
    assert ended.output_file_id is not None
    segments = tmp_path / "shared" / "segments" / batch.id
    refused = segments / "output" / "0" / "99-0.jsonl"
    refused.write_bytes(b'{"custom_id": "r0"}\n')
    other_kind = segments / "errors" / "0" / "99-0.jsonl"
    other_kind.parent.mkdir(parents=True, exist_ok=True)
    other_kind.write_bytes(b'{"custom_id": "r1"}\n')
    await second.delete_file(ended.output_file_id)
    assert not list((segments / "output").rglob("*.jsonl"))
    assert other_kind.exists()
