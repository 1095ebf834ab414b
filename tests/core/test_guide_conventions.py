"""The user guide's conventions by default, OpenAI's one setting away (``error_file``).

Guide: every request has its line in the output file (failed ones with ``response: null`` and
``error`` set), ``error_file_id`` stays null, and a batch that runs out of its completion window
ends ``failed`` with ``batch_failed`` saying so. OpenAI: failed lines in a separate error file, and
such a batch ends ``expired``. Also: a request's ``model`` must be one the server serves, a
streaming request is refused at upload, a create while unhealthy is ServiceUnavailable, and
``output_expires_after`` sets when the result files expire.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from batchgen.core import BatchService, BatchStatus, InvalidBatchFile, ServiceSettings, ServiceUnavailable
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.models import Health
from tests.helpers import chat_line, jsonl, read_jsonl

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _line(custom_id: str, content: str = "hello", **body: object) -> bytes:
    return jsonl(chat_line(custom_id, content, **body))


def _mixed_input(failing: int, passing: int) -> bytes:
    bad = [_line(f"bad{i}", "x " * 50) for i in range(failing)]  # longer than the context
    good = [_line(f"ok{i}") for i in range(passing)]
    return b"".join(bad + good)


@pytest.mark.parametrize(("failing", "passing"), [(1, 0), (2, 3), (5, 1)])
async def test_by_default_every_request_has_its_line_in_the_output_file(
    tmp_path: Path, failing: int, passing: int
) -> None:
    backend = SimulatedBackend(context_length=20)
    async with BatchService(ServiceSettings(storage_path=tmp_path), backend) as service:
        file = await service.create_file(_mixed_input(failing, passing))
        batch = await service.wait_for_batch((await service.create_batch(file.id, "/v1/chat/completions")).id)
        assert batch.status is BatchStatus.COMPLETED
        assert batch.error_file_id is None
        path, _ = await service.file_content(batch.output_file_id or "")
        lines = read_jsonl(path)
        assert path == tmp_path / "incremental" / f"{batch.id}.jsonl"
    assert sorted(line["custom_id"] for line in lines) == sorted(
        [f"bad{i}" for i in range(failing)] + [f"ok{i}" for i in range(passing)]
    )
    failed = [line for line in lines if line["error"] is not None]
    assert {line["custom_id"] for line in failed} == {f"bad{i}" for i in range(failing)}
    assert all(
        line["response"] is None and line["error"]["code"] == "context_length_exceeded" for line in failed
    )
    assert all(set(line["error"]) >= {"code", "message"} for line in failed)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (passing, failing)


async def test_openai_convention_writes_failed_lines_to_a_separate_error_file(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, error_file="openai")
    async with BatchService(settings, SimulatedBackend(context_length=20)) as service:
        file = await service.create_file(_mixed_input(2, 3))
        batch = await service.wait_for_batch((await service.create_batch(file.id, "/v1/chat/completions")).id)
        assert batch.error_file_id is not None
        output, _ = await service.file_content(batch.output_file_id or "")
        errors, _ = await service.file_content(batch.error_file_id)
        assert sorted(line["custom_id"] for line in read_jsonl(output)) == ["ok0", "ok1", "ok2"]
        assert sorted(line["custom_id"] for line in read_jsonl(errors)) == ["bad0", "bad1"]


@pytest.mark.parametrize(
    ("error_file", "status"), [("output", BatchStatus.FAILED), ("openai", BatchStatus.EXPIRED)]
)
async def test_a_batch_out_of_time_ends_as_the_convention_says(
    tmp_path: Path, error_file: str, status: BatchStatus
) -> None:
    settings = ServiceSettings(storage_path=tmp_path, error_file=error_file, max_pool_size=2)
    async with BatchService(settings, SimulatedBackend(latency_s=0.5)) as service:
        file = await service.create_file(b"".join(_line(f"r{i}") for i in range(40)))
        batch = await service.create_batch(file.id, "/v1/chat/completions", completion_window="2s")
        with anyio.fail_after(15):
            batch = await service.wait_for_batch(batch.id)
        assert batch.status is status
        path, _ = await service.file_content(batch.output_file_id or "")
        finished = len(read_jsonl(path))
    assert 0 < finished < 40
    assert batch.request_counts.completed == finished
    if status is BatchStatus.FAILED:
        assert batch.error is not None and batch.error.code == "batch_failed"
        assert "timed out" in batch.error.message and "2s" in batch.error.message
        assert f"{finished} of 40 requests finished" in batch.error.message
        assert batch.failed_at is not None and batch.expired_at is None
    else:
        assert batch.error is None and batch.expired_at is not None


async def test_a_model_the_server_does_not_serve_is_refused_at_upload(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, served_model_names=("team-model", "gpt-x"))
    async with BatchService(settings, SimulatedBackend(model_name="smol")) as service:
        accepted = (
            _line("a") + _line("b", model="default") + _line("c", model="smol") + _line("d", model="gpt-x")
        )
        file = await service.create_file(accepted)
        assert file.line_count == 4
        with pytest.raises(InvalidBatchFile) as raised:
            await service.create_file(_line("a", model="smol") + _line("b", model="llama-70b"))
        assert [problem.line for problem in raised.value.problems] == [2]
        message = raised.value.message
        assert "llama-70b" in message and all(name in message for name in ("smol", "team-model", "gpt-x"))
        assert [model["id"] for model in service.models()] == ["smol", "team-model", "gpt-x"]


@pytest.mark.parametrize("stream", [True, "yes", 1])
async def test_a_streaming_request_is_refused_at_upload(tmp_path: Path, stream: object) -> None:
    async with BatchService(ServiceSettings(storage_path=tmp_path), SimulatedBackend()) as service:
        await service.create_file(_line("fine", stream=False))
        with pytest.raises(InvalidBatchFile) as raised:
            await service.create_file(_line("fine") + _line("streams", stream=stream))
        assert [problem.line for problem in raised.value.problems] == [2]
        assert "stream" in raised.value.message


class SickBackend(SimulatedBackend):
    healthy = True

    def health(self) -> Health:
        return Health(True) if self.healthy else Health(False, "the engine is restarting")


async def test_a_create_while_unhealthy_is_service_unavailable(tmp_path: Path) -> None:
    backend = SickBackend()
    settings = ServiceSettings(storage_path=tmp_path, unhealthy_retry_after_s=7)
    async with BatchService(settings, backend) as service:
        file = await service.create_file(_line("a"))
        backend.healthy = False
        with pytest.raises(ServiceUnavailable) as raised:
            await service.create_batch(file.id, "/v1/chat/completions")
        assert raised.value.retry_after_s == 7 and "the engine is restarting" in raised.value.message
        assert (await service.list_batches())[0] == []  # nothing half made
        backend.healthy = True
        batch = await service.wait_for_batch((await service.create_batch(file.id, "/v1/chat/completions")).id)
        assert batch.status is BatchStatus.COMPLETED


@pytest.mark.parametrize("error_file", ["output", "openai"])
async def test_output_expires_after_sets_the_result_files_expiry(tmp_path: Path, error_file: str) -> None:
    settings = ServiceSettings(storage_path=tmp_path, error_file=error_file)
    async with BatchService(settings, SimulatedBackend(context_length=20)) as service:
        file = await service.create_file(_mixed_input(1, 1))
        batch = await service.create_batch(file.id, "/v1/chat/completions", output_expires_after_s=3600)
        batch = await service.wait_for_batch(batch.id)
        result_ids = [batch.output_file_id] + ([batch.error_file_id] if error_file == "openai" else [])
        for file_id in result_ids:
            result = await service.get_file(file_id or "")
            assert result.expires_at == result.created_at + 3600
        assert (await service.get_file(file.id)).expires_at is None


async def test_a_restart_counts_failed_lines_in_the_output_file_and_writes_none_twice(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=2, shutdown_grace_s=0)
    content = b"".join(_line(f"bad{i}", "x " * 50) if i % 2 else _line(f"ok{i}") for i in range(30))
    async with BatchService(settings, SimulatedBackend(latency_s=0.05, context_length=20)) as service:
        file = await service.create_file(content)
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        with anyio.fail_after(10):
            while (await service.get_batch(batch.id)).request_counts.failed < 3:
                await anyio.sleep(0.01)
    async with BatchService(settings, SimulatedBackend(context_length=20)) as service:
        with anyio.fail_after(10):
            batch = await service.wait_for_batch(batch.id)
        path, _ = await service.file_content(batch.output_file_id or "")
    lines = read_jsonl(path)
    assert sorted(line["custom_id"] for line in lines) == sorted(
        f"bad{i}" if i % 2 else f"ok{i}" for i in range(30)
    )
    assert (batch.request_counts.completed, batch.request_counts.failed) == (15, 15)
