"""The transformers backend's report of its engine (backends.engine_activity), with the tiny
random-weight model in its worker process: tokens are counted while the answers are still being
generated, and the pool status tells the rows the worker computes from the requests admitted
beyond its batch size."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import anyio
import pytest

from batchgen.core import BatchService, PoolStatus, ServiceSettings
from batchgen.core.backends.hf_transformers import TransformersBackend

pytestmark = [pytest.mark.anyio, pytest.mark.model, pytest.mark.live]  # live: it starts a worker process


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _lines(size: int, max_tokens: int) -> bytes:
    rows = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": max_tokens}}
        for i in range(size)
    ]  # fmt: skip
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


async def test_tokens_are_counted_as_the_worker_generates_them_and_running_is_its_batch(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The tiny model has no end-of-sequence token: every answer runs to its 3,000 tokens, so for
    seconds no request finishes, while the count of generated tokens grows with each heartbeat."""
    backend = TransformersBackend(model=str(tiny_model), cache_dir=tmp_path / "models", max_batch_size=2)
    settings = ServiceSettings(storage_path=tmp_path / "storage", max_pool_size=6)
    async with BatchService(settings, backend) as service:
        file = await service.create_file(_lines(6, 3000), filename="in.jsonl")
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        seen: list[PoolStatus] = []
        with anyio.fail_after(120):
            while True:
                status = service.pool_status()
                if status.generated_tokens_total > 0 and status.engine_running == 2:
                    seen.append(status)
                    if len(seen) >= 2 and seen[-1].generated_tokens_total > seen[0].generated_tokens_total:
                        break
                await anyio.sleep(0.2)
        first, later = seen[0], seen[-1]
        for status in (first, later):
            assert status.requests_completed_total == 0 and status.completion_tokens_total == 0
            assert status.generated_tokens_counted == "as_generated"
            assert status.scheduling_pool_active == 6
            assert (status.engine_running, status.engine_waiting) == (2, 4)  # two rows, four waiting
        assert later.tokens_per_second > 0  # the rate moves before any answer has ended
        # a worker that dies is replaced; the count goes on from what the dead one had made
        pid = backend.worker_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(120):
            while backend.worker_pid in (None, pid) or service.pool_status().generated_tokens_total <= (
                later.generated_tokens_total + 10
            ):
                assert service.pool_status().generated_tokens_total >= later.generated_tokens_total
                await anyio.sleep(0.2)
        await service.cancel_batch(batch.id)
        await service.wait_for_batch(batch.id)
        ended = service.pool_status()
        assert ended.generated_tokens_total >= later.generated_tokens_total
