"""Every admitted request ends with exactly one line, whatever the backend does with it.

The backend here is a real ``Backend`` implementation whose behaviour each request picks by its
prompt: answer, reject, fail transiently every time, raise an unexpected exception, or hang until
aborted. (A line with a bad sampling value is refused at upload now, by the request schema:
tests/core/test_request_schema.py.) Hypothesis mixes them in any order and count; the batch must complete with one line per request and counters equal to lines.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends import RequestAborted, RequestRejected, TransientBackendError
from batchgen.core.models import Batch, GenerationRequest, GenerationResult, Health
from tests.examples import examples
from tests.helpers import chat_line, jsonl, read_jsonl

#: What each kind of request does, and the line it must end with (None: an output line).
KINDS: dict[str, str | None] = {
    "answer": None,
    "reject": "context_length_exceeded",
    "flaky": "backend_error",
    "boom": "internal_error",
}


class ScriptedBackend:
    """Does to each request what its prompt says."""

    name = "scripted"
    model_name = "scripted"

    def __init__(self) -> None:
        self.calls = 0
        self._aborts: dict[str, anyio.Event] = {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def health(self) -> Health:
        return Health(True)

    async def abort(self, request_id: str) -> None:
        event = self._aborts.get(request_id)
        if event is not None:
            event.set()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        assert request.messages is not None
        kind = request.messages[0]["content"]
        await anyio.lowlevel.checkpoint()
        if kind == "reject":
            raise RequestRejected("context_length_exceeded", "too long")
        if kind == "flaky":
            raise TransientBackendError("try again")
        if kind == "boom":
            raise ZeroDivisionError("a bug in the backend")
        if kind == "hang":
            event = self._aborts[request.request_id] = anyio.Event()
            await event.wait()
            raise RequestAborted(request.request_id)
        return GenerationResult(text="fine", finish_reason="stop", prompt_tokens=2, completion_tokens=1)


def _line(custom_id: str, kind: str) -> bytes:
    return jsonl(chat_line(custom_id, kind))


async def _run(storage: Path, kinds: list[str]) -> tuple[Batch, list[dict], list[dict]]:
    settings = ServiceSettings(storage_path=storage, max_pool_size=3, max_request_attempts=2)
    async with BatchService(settings, ScriptedBackend()) as service:
        file = await service.create_file(b"".join(_line(f"r{i}", kind) for i, kind in enumerate(kinds)))
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        with anyio.fail_after(30):
            batch = await service.wait_for_batch(batch.id)
        lines = read_jsonl(service.blobs.output_path(batch.id))  # failed requests' lines are here too
        assert not service.blobs.error_path(batch.id).exists()
        output = [line for line in lines if line["error"] is None]
        errors = [line for line in lines if line["error"] is not None]
        return batch, output, errors


@settings(
    max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=12))
def test_every_request_ends_with_exactly_one_line(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[str]
) -> None:
    storage = tmp_path_factory.mktemp("outcomes")
    batch, output, errors = anyio.run(_run, storage, kinds)
    assert batch.status is BatchStatus.COMPLETED
    written = [line["custom_id"] for line in output + errors]
    assert sorted(written) == sorted(f"r{i}" for i in range(len(kinds)))
    codes = {line["custom_id"]: line["error"]["code"] for line in errors}
    for i, kind in enumerate(kinds):
        assert codes.get(f"r{i}") == KINDS[kind], (kind, codes.get(f"r{i}"))
    counts = batch.request_counts
    assert (counts.completed, counts.failed) == (len(output), len(errors))


def test_an_unexpected_exception_is_logged_once_with_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="batchgen.service"):
        _, _, errors = anyio.run(_run, tmp_path, ["boom", "answer"])
    assert [line["custom_id"] for line in errors] == ["r0"]
    assert "ZeroDivisionError: a bug in the backend" in errors[0]["error"]["message"]
    records = [r for r in caplog.records if r.exc_info and "r0" in r.getMessage()]
    assert len(records) == 1
    assert records[0].exc_info is not None and records[0].exc_info[0] is ZeroDivisionError


def test_a_cancelled_batch_ends_its_hanging_requests_with_no_line(tmp_path: Path) -> None:
    async def main() -> None:
        settings = ServiceSettings(storage_path=tmp_path, max_pool_size=4)
        async with BatchService(settings, ScriptedBackend()) as service:
            file = await service.create_file(
                _line("done", "answer") + _line("h1", "hang") + _line("h2", "hang")
            )
            batch = await service.create_batch(file.id, "/v1/chat/completions")
            with anyio.fail_after(10):
                while (await service.get_batch(batch.id)).request_counts.completed < 1:
                    await anyio.sleep(0.01)
                await service.cancel_batch(batch.id)
                batch = await service.wait_for_batch(batch.id)
            assert batch.status is BatchStatus.CANCELLED
            assert [line["custom_id"] for line in read_jsonl(service.blobs.output_path(batch.id))] == ["done"]
            assert service.scheduling_pool.active == 0

    anyio.run(main)
