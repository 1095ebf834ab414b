"""What the pool status says the engine is doing (backends.engine_activity): requests running on
the engine versus admitted and waiting for it, and tokens counted as they are generated, on the
embedded service with the simulated backend (and backends that report less, or more)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from batchgen.core import BatchService, PoolStatus, ServiceSettings
from batchgen.core.backends.engine_activity import EngineActivity, activity_of, combined_activity
from batchgen.core.backends.served_models import ServedModel
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.models import GenerationRequest, GenerationResult

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _lines(size: int) -> bytes:
    rows = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": f"question {i}"}]}}
        for i in range(size)
    ]  # fmt: skip
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


async def _until(service: BatchService, ready: Callable[[PoolStatus], bool]) -> PoolStatus:
    with anyio.fail_after(30):
        while True:
            status = service.pool_status()
            if ready(status):
                return status
            await anyio.sleep(0.01)


async def _submit(service: BatchService, size: int) -> str:
    file = await service.create_file(_lines(size), filename="in.jsonl")
    return (await service.create_batch(file.id, "/v1/chat/completions")).id


class Unreporting:
    """A backend that says nothing of its engine (as the openai and sglang backends): the
    simulated one, without its ``engine_activity``."""

    def __init__(self, inner: SimulatedBackend) -> None:
        self._inner = inner
        self.name = "unreporting"

    def __getattr__(self, name: str) -> Any:
        if name == "engine_activity":
            raise AttributeError(name)
        return getattr(self._inner, name)


class Streaming(SimulatedBackend):
    """A simulated engine that makes its tokens as it goes (one per ``token_latency_s``), and
    says how many it has made: as the transformers worker does."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._made = 0
        self._started_at: dict[str, float] = {}

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._started_at[request.request_id] = anyio.current_time()
        try:
            result = await super().generate(request)
        finally:
            began = self._started_at.pop(request.request_id)
        self._made += self._so_far(began, result.completion_tokens, ended=True)
        return result

    def _so_far(self, began: float, limit: int, *, ended: bool = False) -> int:
        if ended:
            return limit
        return min(limit, int((anyio.current_time() - began) / self.token_latency_s))

    def engine_activity(self) -> EngineActivity:
        running = super().engine_activity().running
        in_flight = sum(self._so_far(began, 48) for began in self._started_at.values())
        return EngineActivity(running=running, generated_tokens=self._made + in_flight)


async def test_admitted_requests_beyond_the_engines_capacity_are_shown_waiting_for_it(tmp_path: Path) -> None:
    """10 slots, an engine that computes 3 requests at a time: 3 running, 7 admitted and waiting."""
    backend = SimulatedBackend(latency_s=0.3, capacity=3)
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=10)
    async with BatchService(settings, backend) as service:
        await _submit(service, 40)
        busy = await _until(service, lambda s: s.scheduling_pool_active == 10 and s.engine_running == 3)
        assert busy.engine_waiting == 7
        assert (
            busy.to_dict()["engine_running"] + busy.to_dict()["engine_waiting"] == busy.scheduling_pool_active
        )
        idle = await _until(service, lambda s: s.requests_completed_total == 40)
        assert (idle.engine_running, idle.engine_waiting) == (0, 0)


async def test_a_backend_that_cannot_tell_leaves_running_unknown_not_guessed(tmp_path: Path) -> None:
    backend = Unreporting(SimulatedBackend(latency_s=0.3, capacity=3))
    assert activity_of(backend) == EngineActivity()
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=10)
    async with BatchService(settings, backend) as service:
        await _submit(service, 20)
        busy = await _until(service, lambda s: s.scheduling_pool_active == 10)
        assert busy.engine_running is None and busy.engine_waiting is None
        assert busy.generated_tokens_counted == "when_finished"
        done = await _until(service, lambda s: s.requests_completed_total == 20)
        assert done.generated_tokens_total == done.completion_tokens_total > 0


async def test_one_model_that_cannot_tell_makes_the_sum_unknown(tmp_path: Path) -> None:
    reporting = SimulatedBackend(model_name="a")
    silent = Unreporting(SimulatedBackend(model_name="b"))
    assert combined_activity([reporting]).running == 0
    assert combined_activity([reporting, silent]) == EngineActivity()
    models = [ServedModel(reporting), ServedModel(silent)]
    async with BatchService(ServiceSettings(storage_path=tmp_path), models) as service:
        assert service.pool_status().engine_running is None


async def test_tokens_are_counted_as_they_are_generated_before_any_request_finishes(tmp_path: Path) -> None:
    backend = Streaming(token_latency_s=0.05, latency_s=0.5, capacity=8)
    settings = ServiceSettings(storage_path=tmp_path, max_pool_size=8)
    async with BatchService(settings, backend) as service:
        await _submit(service, 8)
        early = await _until(service, lambda s: s.generated_tokens_total >= 16)
        assert early.requests_completed_total == 0 and early.completion_tokens_total == 0
        assert early.generated_tokens_counted == "as_generated"
        assert early.tokens_per_second > 0  # the rate moves before the first answer ends
        done = await _until(service, lambda s: s.requests_completed_total == 8)
        assert done.generated_tokens_total >= done.completion_tokens_total


async def test_a_broken_report_is_unknown_and_never_breaks_the_pool_status() -> None:
    class Broken:
        def engine_activity(self) -> EngineActivity:
            raise RuntimeError("boom")

    class Odd:
        def engine_activity(self) -> object:
            return {"running": 3}

    assert activity_of(Broken()) == activity_of(Odd()) == EngineActivity()
