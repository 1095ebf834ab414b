"""BatchService embedded in-process, with no HTTP, as a custom pipeline would use it."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from batchgen.core import BatchParameters, BatchService, BatchStatus, ServiceSettings, load_backend

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _line(custom_id: str, content: str = "What is 2+2?", **body: object) -> bytes:
    request = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}], **body},
    }
    return json.dumps(request).encode() + b"\n"


def _read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_pipeline_runs_a_batch_without_http(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path)
    async with BatchService(settings, load_backend("simulated", seed=7)) as service:
        file = await service.create_file(
            b"".join(_line(f"q{i}", f"prompt {i}") for i in range(100)), filename="in.jsonl"
        )
        assert (file.line_count, file.url) == (100, "/v1/chat/completions")
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        batch = await service.wait_for_batch(batch.id)
        assert batch.status is BatchStatus.COMPLETED
        assert (batch.request_counts.completed, batch.request_counts.failed) == (100, 0)
        path, size = await service.file_content(batch.output_file_id or "")
        lines = _read_lines(path)
        assert size == path.stat().st_size
        assert sorted(line["custom_id"] for line in lines) == sorted(f"q{i}" for i in range(100))
        assert batch.usage.completion_tokens == sum(
            line["response"]["body"]["usage"]["completion_tokens"] for line in lines
        )
        assert service.pool_status().active_batches == 0


async def test_same_seed_gives_the_same_text(tmp_path: Path) -> None:
    texts = []
    for run in range(2):
        async with BatchService(
            ServiceSettings(storage_path=tmp_path / str(run)), load_backend("simulated", seed=3)
        ) as service:
            file = await service.create_file(_line("only", "tell me a story"))
            batch = await service.wait_for_batch(
                (await service.create_batch(file.id, "/v1/chat/completions")).id
            )
            path, _ = await service.file_content(batch.output_file_id or "")
            texts.append(_read_lines(path)[0]["response"]["body"]["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and texts[0]


async def test_output_limit_priority_body_then_batch_then_server(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, default_max_tokens=2)
    async with BatchService(settings, load_backend("simulated")) as service:
        content = (
            _line("body-max-completion", max_completion_tokens=1, max_tokens=3)
            + _line("body-max-tokens", max_tokens=3)
            + _line("batch-level")
        )
        file = await service.create_file(content)
        batch = await service.create_batch(
            file.id, "/v1/chat/completions", parameters=BatchParameters(max_decoding_length=4)
        )
        batch = await service.wait_for_batch(batch.id)
        path, _ = await service.file_content(batch.output_file_id or "")
        usage = {
            line["custom_id"]: line["response"]["body"]["usage"]["completion_tokens"]
            for line in _read_lines(path)
        }
        finish = {
            line["custom_id"]: line["response"]["body"]["choices"][0]["finish_reason"]
            for line in _read_lines(path)
        }
        assert usage == {"body-max-completion": 1, "body-max-tokens": 3, "batch-level": 4}
        assert set(finish.values()) == {"length"}

        file = await service.create_file(_line("server-default"))
        batch = await service.wait_for_batch((await service.create_batch(file.id, "/v1/chat/completions")).id)
        path, _ = await service.file_content(batch.output_file_id or "")
        assert _read_lines(path)[0]["response"]["body"]["usage"]["completion_tokens"] == 2


async def test_prompt_too_long_is_an_error_line_and_the_batch_goes_on(tmp_path: Path) -> None:
    async with BatchService(
        ServiceSettings(storage_path=tmp_path), load_backend("simulated", context_length=50)
    ) as service:
        long_prompt = " ".join(["word"] * 200)
        file = await service.create_file(_line("short") + _line("long", long_prompt) + _line("short-2"))
        batch = await service.wait_for_batch((await service.create_batch(file.id, "/v1/chat/completions")).id)
        assert batch.status is BatchStatus.COMPLETED
        assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
        assert batch.error_file_id is None  # the failed request's line is in the output file
        output, _ = await service.file_content(batch.output_file_id or "")
        lines = _read_lines(output)
        [error] = [line for line in lines if line["error"] is not None]
        assert error["custom_id"] == "long" and error["response"] is None
        assert error["error"] == {
            "code": "context_length_exceeded",
            "message": "Prompt length 203 exceeds model context 50",
        }
        assert {line["custom_id"] for line in lines if line["error"] is None} == {"short", "short-2"}


@pytest.mark.parametrize("failure_rate", [0.3, 1.0])
async def test_injected_failures_are_retried_then_written_as_errors(
    tmp_path: Path, failure_rate: float
) -> None:
    backend = load_backend("simulated", failure_rate=failure_rate, seed=1)
    async with BatchService(
        ServiceSettings(storage_path=tmp_path, max_request_attempts=3), backend
    ) as service:
        file = await service.create_file(b"".join(_line(f"r{i}") for i in range(200)))
        batch = await service.wait_for_batch((await service.create_batch(file.id, "/v1/chat/completions")).id)
        assert batch.status is BatchStatus.COMPLETED
        lines = _read_lines(service.blobs.output_path(batch.id))
        output = [line for line in lines if line["error"] is None]
        errors = [line for line in lines if line["error"] is not None]
        # Counters equal the lines written, and every request ends exactly once.
        assert (batch.request_counts.completed, batch.request_counts.failed) == (len(output), len(errors))
        ids = [line["custom_id"] for line in output + errors]
        assert sorted(ids) == sorted(f"r{i}" for i in range(200))
        assert all(line["error"]["code"] == "backend_error" for line in errors)
        if failure_rate == 1.0:
            assert len(errors) == 200
        else:
            # 0.3 per attempt and 3 attempts: about 2.7% fail all three; most succeed after a retry.
            assert 0 < len(errors) < 20 and len(output) > 180


async def test_output_of_a_running_batch_has_the_lines_written_so_far(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=4)
    async with BatchService(settings, load_backend("simulated", latency_s=0.05)) as service:
        file = await service.create_file(b"".join(_line(f"r{i}") for i in range(80)))
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        while (batch := await service.get_batch(batch.id)).request_counts.completed < 8:
            await anyio.sleep(0.01)
        assert batch.status is BatchStatus.IN_PROGRESS
        path, size = await service.file_content(batch.output_file_id or "")
        partial = path.read_bytes()[:size]
        assert partial.endswith(b"\n")
        assert 8 <= len(partial.splitlines()) < 80
        pool = service.pool_status()
        assert pool.scheduling_pool_active == 4 and pool.intake_pool_size > 0
        batch = await service.cancel_batch(batch.id)
        assert (await service.wait_for_batch(batch.id)).status is BatchStatus.CANCELLED


async def test_reopening_the_storage_resumes_an_unfinished_batch_exactly_once(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=8)
    async with BatchService(settings, load_backend("simulated", latency_s=0.02)) as service:
        file = await service.create_file(b"".join(_line(f"r{i}") for i in range(300)))
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        while (await service.get_batch(batch.id)).request_counts.completed < 40:
            await anyio.sleep(0.01)
    output = service.blobs.output_path(batch.id)
    before = output.read_bytes()
    assert 40 <= len(before.splitlines()) < 300

    async with BatchService(settings, load_backend("simulated")) as service:
        resumed = await service.wait_for_batch(batch.id)
    assert resumed.status is BatchStatus.COMPLETED
    after = output.read_bytes()
    assert after.startswith(before), "lines written before the restart are unchanged"
    ids = [line["custom_id"] for line in _read_lines(output)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(300))
    assert resumed.request_counts.completed == 300


def test_a_service_under_plain_asyncio_run_ends_requests_reported_by_timers(tmp_path: Path) -> None:
    """Requests the backend reports from loop callbacks (its timers), with retries, under a plain
    ``asyncio.run`` as an embedding program (or uvicorn) has it, not a test runner's loop."""
    import asyncio

    async def run() -> tuple[object, list[bytes]]:
        settings = ServiceSettings(storage_path=tmp_path, max_pool_size=16)
        backend = load_backend("simulated", latency_s=0.01, failure_rate=0.2)
        async with BatchService(settings, backend) as service:
            file = await service.create_file(b"".join(_line(f"r{i}") for i in range(100)))
            batch = await service.create_batch(file.id, "/v1/chat/completions")
            batch = await asyncio.wait_for(service.wait_for_batch(batch.id, poll_interval=0.01), 60)
            path, size = await service.file_content(batch.output_file_id or "")
            return batch, path.read_bytes()[:size].splitlines()

    batch, lines = asyncio.run(run())
    assert batch.status is BatchStatus.COMPLETED  # type: ignore[attr-defined]
    assert sorted(json.loads(line)["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(100))


async def test_a_group_spanning_two_models_goes_to_each_backend_with_only_its_own_requests(
    tmp_path: Path,
) -> None:
    """Two batches on two models run together: the scheduler's groups mix their requests, and the
    executor hands each backend (one ``generate_many`` call per backend and group) only the
    requests of its own model, each once; every line names the model that ran it."""
    from collections.abc import Sequence

    from batchgen.core.backends.base import ReportOutcome
    from batchgen.core.backends.served_models import ServedModel
    from batchgen.core.backends.simulated import SimulatedBackend
    from batchgen.core.models import GenerationRequest

    class Recording(SimulatedBackend):
        def __init__(self, model_name: str) -> None:
            super().__init__(latency_s=0.002, model_name=model_name)
            self.seen: list[str] = []

        async def generate_many(self, requests: Sequence[GenerationRequest], report: ReportOutcome) -> None:
            self.seen.extend(str((request.messages or ({},))[0].get("content")) for request in requests)
            await super().generate_many(requests, report)

    first, second = Recording("first"), Recording("second")
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=32)
    async with BatchService(settings, [ServedModel(first), ServedModel(second)]) as service:
        batches = []
        for model in ("first", "second"):
            content = b"".join(_line(f"{model}-{i}", f"{model}-{i}", model=model) for i in range(200))
            file = await service.create_file(content)
            batches.append(await service.create_batch(file.id, "/v1/chat/completions"))
        for batch in batches:
            done = await service.wait_for_batch(batch.id, poll_interval=0.01)
            assert done.status is BatchStatus.COMPLETED
            path, _ = await service.file_content(done.output_file_id or "")
            lines = _read_lines(path)
            model = done.model
            assert {line["response"]["body"]["model"] for line in lines} == {model}
            assert sorted(line["custom_id"] for line in lines) == sorted(f"{model}-{i}" for i in range(200))
    assert sorted(first.seen) == sorted(f"first-{i}" for i in range(200))
    assert sorted(second.seen) == sorted(f"second-{i}" for i in range(200))
