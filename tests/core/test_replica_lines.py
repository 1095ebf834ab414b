"""The replica's line path gives each request line the line the single process gives it.

``LineRunner`` is what a replica runs a shared batch's lines with. Hypothesis mixes requests that
answer, are rejected, fail transiently on every attempt, fail transiently once and then answer,
or raise something unexpected; the same file is run by a ``BatchService`` and, line by line, by a
``LineRunner`` over the service's own metadata store, and the two must give every request the
same line (ids and timestamps aside), in the same kind of file. What says the replica cannot
answer now (the backend gone, an aborted request, an input that is gone or changed) is raised, so
the shard runs again. ``BatchInputs`` opens a batch's input once however many lines ask at once,
keeps ``max_open`` inputs open, and reads lines past a megabyte off the event loop.

Last, on a real PostgreSQL: two ``ShardRunner`` with ``LineRunner`` over a
``PostgresMetadataStore`` run a batch of 400 chat lines on the simulated backend, and every line
is committed exactly once, as an output line of the batch's endpoint.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends import BackendUnavailable, RequestAborted, TransientBackendError
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.execution.replica_lines import LineRunner
from batchgen.core.files.batch_inputs import BatchInputs, InputGone
from batchgen.core.files.line_blocks import InputChanged
from batchgen.core.models import Batch, BatchParameters, FileObject, GenerationRequest, GenerationResult
from batchgen.core.storage import MetadataStore, SQLiteMetadataStore
from batchgen.core.storage.postgres_metadata import PostgresMetadataStore
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.shard_runner import ShardRunner
from batchgen.core.work.shards import ERRORS, OUTPUT
from tests.core.test_request_outcomes import ScriptedBackend
from tests.examples import examples
from tests.helpers import chat_line, jsonl, read_jsonl

#: Fields that differ between two runs of one request: generated ids and clock readings.
_VARYING = ("id", "request_id", "created", "created_at", "system_fingerprint")


class _ReplicaBackend(ScriptedBackend):
    """The scripted backend, with requests that fail transiently once and then answer (known
    apart by their seed)."""

    def __init__(self) -> None:
        super().__init__()
        self._failed_once: set[int | None] = set()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        assert request.messages is not None
        if request.messages[0]["content"] != "flaky-once":
            return await super().generate(request)
        if request.sampling.seed not in self._failed_once:
            self._failed_once.add(request.sampling.seed)
            raise TransientBackendError("once")
        return GenerationResult(text="at last", finish_reason="stop", prompt_tokens=2, completion_tokens=2)


def _stable(value: Any) -> Any:
    """A line with the fields that vary between runs taken out."""
    if isinstance(value, dict):
        return {key: _stable(item) for key, item in value.items() if key not in _VARYING}
    if isinstance(value, list):
        return [_stable(item) for item in value]
    return value


async def _both_ways(storage: Path, kinds: list[str], separate: bool) -> tuple[dict, dict, Batch]:
    """The file's lines as the service wrote them, and as a ``LineRunner`` makes them, each by
    custom_id as (kind, line)."""
    settings = ServiceSettings(
        storage_path=storage,
        max_pool_size=3,
        max_request_attempts=2,
        error_file="openai" if separate else "output",
    )
    lines = [chat_line(f"r{i}", kind, seed=i) for i, kind in enumerate(kinds)]
    async with BatchService(settings, _ReplicaBackend()) as service:
        file = await service.create_file(jsonl(*lines))
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        with anyio.fail_after(30):
            batch = await service.wait_for_batch(batch.id)
        by_service = {
            line["custom_id"]: (kind, _stable(line))
            for kind, path in (
                (OUTPUT, service.blobs.output_path(batch.id)),
                (ERRORS, service.blobs.error_path(batch.id)),
            )
            for line in read_jsonl(path)
        }
        inputs = BatchInputs(service.metadata)
        runner = LineRunner(
            _ReplicaBackend(), inputs, max_attempts=2, separate_error_file=separate, backoff_s=0
        )
        made = [await runner(batch.id, number) for number in range(len(kinds))]
        inputs.close()
    by_runner = {}
    for result in made:
        line = json.loads(result.data)
        assert result.data.endswith(b"\n") and result.data.count(b"\n") == 1
        by_runner[line["custom_id"]] = (result.kind, _stable(line))
    return by_service, by_runner, batch


@settings(
    max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kinds=st.lists(
        st.sampled_from(["answer", "reject", "flaky", "flaky-once", "boom"]), min_size=1, max_size=10
    ),
    separate=st.booleans(),
)
def test_a_replica_gives_each_line_the_line_the_single_process_gives_it(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[str], separate: bool
) -> None:
    by_service, by_runner, batch = anyio.run(_both_ways, tmp_path_factory.mktemp("lines"), kinds, separate)
    assert batch.status is BatchStatus.COMPLETED
    assert sorted(by_runner) == sorted(f"r{i}" for i in range(len(kinds)))
    assert by_runner == by_service


def _store_with_batch(tmp_path: Path, content: bytes, batch_id: str = "batch_1") -> SQLiteMetadataStore:
    path = tmp_path / "input.jsonl"
    path.write_bytes(content)
    store = SQLiteMetadataStore(tmp_path / "metadata.sqlite3")
    _record(store, path, batch_id)
    return store


def _record(store: MetadataStore, path: Path, batch_id: str, file_id: str = "file_1") -> None:
    if store.get_file(file_id) is None:
        store.insert_file(FileObject(file_id, path.stat().st_size, 1, "input.jsonl", "batch", str(path)))
    batch = Batch(
        id=batch_id,
        endpoint="/v1/chat/completions",
        input_file_id=file_id,
        completion_window="24h",
        status=BatchStatus.IN_PROGRESS,
        created_at=1,
        expires_at=2**40,
        model="default",
        parameters=BatchParameters(),
    )
    store.insert_batch(batch)


class _CountingStore:
    """A metadata store that counts its ``get_batch`` calls (and yields in each, as a database's
    call would), over a real SQLite store."""

    def __init__(self, store: SQLiteMetadataStore) -> None:
        self.store = store
        self.get_batch_calls = 0

    def get_batch(self, batch_id: str) -> Batch | None:
        self.get_batch_calls += 1
        return self.store.get_batch(batch_id)

    def get_file(self, file_id: str) -> FileObject | None:
        return self.store.get_file(file_id)


async def _simulated() -> SimulatedBackend:
    backend = SimulatedBackend()
    await backend.start()
    return backend


@pytest.mark.anyio
async def test_lines_asking_for_one_batch_at_once_share_one_opening(tmp_path: Path) -> None:
    content = b"\n".join(jsonl(chat_line(f"r{i}")) for i in range(50))  # blank lines between
    counting = _CountingStore(_store_with_batch(tmp_path, content))
    inputs = BatchInputs(counting)  # type: ignore[arg-type]
    runner = LineRunner(await _simulated(), inputs)
    results = await asyncio.gather(*(runner("batch_1", number) for number in range(50)))
    assert counting.get_batch_calls == 1
    assert [json.loads(result.data)["custom_id"] for result in results] == [f"r{i}" for i in range(50)]
    assert {result.kind for result in results} == {OUTPUT}
    with pytest.raises(IndexError):
        await runner("batch_1", 50)
    inputs.close()


@pytest.mark.anyio
async def test_inputs_past_max_open_are_closed_and_opened_again_when_asked(tmp_path: Path) -> None:
    store = _store_with_batch(tmp_path, jsonl(chat_line("a"), chat_line("b")), "batch_0")
    for number in range(1, 4):
        _record(store, tmp_path / "input.jsonl", f"batch_{number}")
    counting = _CountingStore(store)
    inputs = BatchInputs(counting, max_open=2)  # type: ignore[arg-type]
    opened = [await inputs.open(f"batch_{number}") for number in range(4)]
    assert [found.closed for found in opened] == [True, True, False, False]
    again = await inputs.open("batch_0")
    assert not again.closed and counting.get_batch_calls == 5
    assert await again.line(1) == jsonl(chat_line("b"))
    inputs.forget("batch_0")
    assert again.closed
    inputs.close()
    assert all(found.closed for found in opened)


@pytest.mark.anyio
async def test_a_line_past_a_megabyte_is_read_whole(tmp_path: Path) -> None:
    long = jsonl(chat_line("long", "x" * (1 << 20) + "y"))
    store = _store_with_batch(tmp_path, jsonl(chat_line("short")) + long)
    inputs = BatchInputs(store)
    opened = await inputs.open("batch_1")
    assert await opened.line(1) == long
    result = await LineRunner(await _simulated(), inputs)("batch_1", 1)
    assert json.loads(result.data)["custom_id"] == "long"
    inputs.close()


@pytest.mark.anyio
async def test_what_the_replica_cannot_answer_now_is_raised_not_written(tmp_path: Path) -> None:
    path = tmp_path / "input.jsonl"
    store = _store_with_batch(tmp_path, jsonl(chat_line("gone"), chat_line("aborted")))

    inputs = BatchInputs(store)
    with pytest.raises(InputGone):
        await LineRunner(await _simulated(), inputs)("batch_nope", 0)

    class _Gone(SimulatedBackend):
        async def generate(self, request: GenerationRequest) -> GenerationResult:
            raise BackendUnavailable("the engine died")

    class _Aborted(SimulatedBackend):
        async def generate(self, request: GenerationRequest) -> GenerationResult:
            raise RequestAborted(request.request_id)

    with pytest.raises(BackendUnavailable):
        await LineRunner(_Gone(), inputs)("batch_1", 0)
    with pytest.raises(RequestAborted):
        await LineRunner(_Aborted(), inputs)("batch_1", 1)
    path.write_bytes(jsonl(chat_line("gone")))  # the file shrank after it was indexed
    with pytest.raises(InputChanged):
        await LineRunner(await _simulated(), inputs)("batch_1", 1)
    inputs.close()
    store.close()


def test_a_line_runner_refuses_no_attempts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        LineRunner(
            SimulatedBackend(), BatchInputs(SQLiteMetadataStore(tmp_path / "m.sqlite3")), max_attempts=0
        )
    with pytest.raises(ValueError, match="max_open"):
        BatchInputs(SQLiteMetadataStore(tmp_path / "m.sqlite3"), max_open=0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_two_replicas_run_a_shared_batch_on_postgres_and_commit_every_line_once(
    postgres_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "shared" / "input.jsonl"
    path.parent.mkdir()
    path.write_bytes(jsonl(*(chat_line(f"r{i}", f"question {i}") for i in range(400))))
    metadata = PostgresMetadataStore(postgres_url)
    _record(metadata, path, "batch_shared")
    segments = SegmentFiles(tmp_path / "segments")
    replica_stores: list[PostgresMetadataStore] = []
    inputs_of_replicas: list[BatchInputs] = []
    runners: list[ShardRunner] = []
    try:
        async with PostgresShardLedger(postgres_url) as ledger:
            await ledger.create_schema()
            await ledger.add_batch("batch_shared", 400, shard_lines=20)
            for replica in ("replica-a", "replica-b"):
                backend = SimulatedBackend(latency_s=0.002)
                await backend.start()
                replica_stores.append(PostgresMetadataStore(postgres_url))  # each its own
                inputs = BatchInputs(replica_stores[-1])
                inputs_of_replicas.append(inputs)
                runners.append(
                    ShardRunner(
                        ledger,
                        segments,
                        LineRunner(backend, inputs),
                        replica_id=replica,
                        max_shards=2,
                        commit_interval_s=0.05,
                        poll_s=0.05,
                    )
                )
            tasks = [asyncio.create_task(runner.run()) for runner in runners]
            with anyio.fail_after(60):
                while (work := await ledger.batch("batch_shared")) is None or work.status != "finished":
                    await asyncio.sleep(0.05)
            for runner in runners:
                runner.stop()
            await asyncio.gather(*tasks)
            assert await ledger.segments("batch_shared", ERRORS) == []
            committed = b"".join(segments.read(await ledger.segments("batch_shared", OUTPUT)))
    finally:
        for inputs in inputs_of_replicas:
            inputs.close()
        for store in [metadata, *replica_stores]:
            store.close()
    lines = [json.loads(line) for line in committed.splitlines()]
    assert Counter(line["custom_id"] for line in lines) == Counter(f"r{i}" for i in range(400))
    assert {line["response"]["status_code"] for line in lines} == {200}
    assert {line["response"]["body"]["object"] for line in lines} == {"chat.completion"}
    assert all(runner.lines_committed > 0 for runner in runners)
    assert work.completed == 400 and work.failed == 0
