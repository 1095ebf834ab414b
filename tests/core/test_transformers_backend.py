"""TransformersBackend with a tiny random-weight model: per-row limits, abort, batching, text rules.

The tiny model (``tiny_model`` in tests/conftest.py) uses SmolLM2's tokenizer and has no
end-of-sequence token, so every row runs to its own limit unless aborted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import attrs
import pytest

from batchgen.core.backends import RequestAborted, RequestRejected
from batchgen.core.backends.hf_transformers import TransformersBackend
from batchgen.core.models import CHAT_COMPLETIONS, GenerationRequest, GenerationResult, SamplingParameters

pytestmark = [pytest.mark.anyio, pytest.mark.model, pytest.mark.live]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _request(request_id: str, max_tokens: int, content: str = "Hello there") -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        endpoint=CHAT_COMPLETIONS,
        sampling=SamplingParameters(max_tokens=max_tokens),
        messages=({"role": "user", "content": content},),
    )


async def test_rows_of_one_batch_stop_at_their_own_limits(tiny_model: Path, tmp_path: Path) -> None:
    backend = TransformersBackend(model=str(tiny_model), cache_dir=tmp_path, max_batch_size=8)
    await backend.start()
    results: dict[str, GenerationResult] = {}
    try:

        async def run(n: int) -> None:
            results[f"r{n}"] = await backend.generate(
                _request(f"r{n}", max_tokens=3 + n, content=f"Prompt number {n}")
            )

        async with anyio.create_task_group() as tasks:
            for n in range(12):
                tasks.start_soon(run, n)
    finally:
        await backend.stop()
    assert {name: result.completion_tokens for name, result in results.items()} == {
        f"r{n}": 3 + n for n in range(12)
    }
    assert {result.finish_reason for result in results.values()} == {"length"}
    assert len({result.prompt_tokens for result in results.values()}) > 1, (
        "prompt tokens are per row, not padded"
    )


async def test_abort_stops_a_running_request_and_the_backend_goes_on(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An abort by id ends a request that is generating (its call raises RequestAborted long
    before its 3,000-token limit), and the backend keeps serving the next request."""
    backend = TransformersBackend(model=str(tiny_model), cache_dir=tmp_path)
    await backend.start()
    try:
        await backend.generate(_request("warm", max_tokens=2))  # the worker is up and the model loaded

        async def abort_once_running() -> None:
            await anyio.sleep(0.2)
            await backend.abort("long")

        with pytest.raises(ExceptionGroup) as raised:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(abort_once_running)
                await backend.generate(_request("long", max_tokens=3000))
        assert raised.group_contains(RequestAborted)
        assert backend.health().healthy
        after = await backend.generate(_request("after", max_tokens=3))
        assert after.completion_tokens == 3
    finally:
        await backend.stop()


async def test_text_parts_are_joined_and_a_think_block_the_template_opened_is_reasoning(
    tiny_model: Path, tmp_path: Path
) -> None:
    thinking = tmp_path / "thinking"
    shutil.copytree(tiny_model, thinking)
    template = thinking / "chat_template.jinja"
    opening = "'<|im_start|>assistant\n'"
    assert opening in template.read_text()
    template.write_text(template.read_text().replace(opening, "'<|im_start|>assistant\n<think>\n'"))
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    request = GenerationRequest(
        request_id="parts",
        endpoint=CHAT_COMPLETIONS,
        sampling=SamplingParameters(max_tokens=5),
        messages=({"role": "user", "content": parts},),
    )
    results = {}
    for name, model in (("plain", tiny_model), ("thinking", thinking)):
        backend = TransformersBackend(model=str(model), cache_dir=tmp_path)
        await backend.start()
        try:
            results[name] = await backend.generate(request)
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            with pytest.raises(RequestRejected, match="takes text content only"):
                await backend.generate(
                    attrs.evolve(
                        request, request_id="image", messages=({"role": "user", "content": [image]},)
                    )
                )
        finally:
            await backend.stop()
    # The tiny model never writes </think>: inside a block the template opened, it is all reasoning.
    assert results["plain"].reasoning_content is None and results["plain"].text
    assert results["thinking"].text == "" and results["thinking"].reasoning_content is not None
    assert results["thinking"].completion_tokens == 5
