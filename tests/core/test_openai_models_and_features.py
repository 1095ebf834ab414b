"""The openai backend's model discovery and routing, embeddings and passed-through features, over
the fake upstreams of ``test_openai_upstream`` (httpx.MockTransport); and the service serving it
next to another model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.served_models import ServedModel
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.models import EMBEDDINGS, GenerationRequest, SamplingParameters
from tests.core.test_openai_upstream import FakeFleet
from tests.helpers import chat_line, jsonl


def _chat(model: str | None = None, **options: Any) -> GenerationRequest:
    return GenerationRequest(
        "r1",
        "/v1/chat/completions",
        SamplingParameters(max_tokens=8),
        messages=({"role": "user", "content": "hi"},),
        model=model,
        options=options,
    )


@pytest.mark.anyio
async def test_each_upstream_gets_only_the_models_it_lists() -> None:
    fleet = FakeFleet(3)
    fleet[0].model, fleet[1].model, fleet[2].model = "small", "large", "large"
    backend = fleet.backend()
    await backend.start()
    try:
        assert backend.model_name == "small"  # the first model the first upstream lists
        assert backend.model_names == ("small", "large")
        for _ in range(6):
            await backend.generate(_chat("large"))
        await backend.generate(_chat())
        assert [body["model"] for body in fleet[0].bodies] == ["small"]
        assert len(fleet[1].bodies) + len(fleet[2].bodies) == 6
        assert {body["model"] for body in fleet[1].bodies + fleet[2].bodies} == {"large"}
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_features_are_passed_through_and_choices_kept_as_answered() -> None:
    fleet = FakeFleet(1)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": f"a{i}"},
            "logprobs": {"content": []},
            "finish_reason": "stop",
        }
        for i in range(3)
    ]
    fleet[0].answer = {"choices": choices, "usage": {"prompt_tokens": 4, "completion_tokens": 6}}
    backend = fleet.backend()
    await backend.start()
    try:
        schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        result = await backend.generate(_chat(n=3, logprobs=True, top_logprobs=2, response_format=schema))
        [sent] = fleet[0].bodies
        assert (sent["n"], sent["logprobs"], sent["top_logprobs"], sent["response_format"]) == (
            3,
            True,
            2,
            schema,
        )
        assert result.choices is not None and [c["message"]["content"] for c in result.choices] == [
            "a0",
            "a1",
            "a2",
        ]
        assert result.text == "a0"
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_embeddings_are_forwarded_and_read_back_in_input_order() -> None:
    fleet = FakeFleet(1)
    fleet[0].answer = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]},
            {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
        ],
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    backend = fleet.backend()
    await backend.start()
    try:
        request = GenerationRequest(
            "e1",
            EMBEDDINGS,
            SamplingParameters(max_tokens=1),
            inputs=("a", (1, 2)),
            options={"dimensions": 2},
        )
        result = await backend.generate(request)
        [sent] = fleet[0].bodies
        assert sent == {
            "model": "fake-model",
            "input": ["a", [1, 2]],
            "encoding_format": "float",
            "dimensions": 2,
        }
        assert result.embeddings == ((1.0, 0.0), (0.0, 1.0)) and result.prompt_tokens == 7
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_a_service_routes_lines_to_an_upstream_model_next_to_a_local_one(tmp_path: Path) -> None:
    fleet = FakeFleet(2)
    fleet[0].model, fleet[1].model = "remote-a", "remote-b"
    models = [ServedModel(SimulatedBackend(), name="local"), ServedModel(fleet.backend(), name="remote")]
    async with BatchService(ServiceSettings(storage_path=tmp_path), models) as service:
        assert set(service.accepted_model_names()) >= {"local", "remote", "remote-a", "remote-b", "default"}
        file = await service.create_file(jsonl(*(chat_line(f"q{i}", model="remote-b") for i in range(4))))
        batch = await service.wait_for_batch((await service.create_batch(file.id, "/v1/chat/completions")).id)
        assert batch.model == "remote" and batch.request_counts.completed == 4
        assert len(fleet[1].bodies) == 4 and not fleet[0].bodies
        output = (tmp_path / "incremental" / f"{batch.id}.jsonl").read_text()
        assert output.count('"model":"remote-b"') == 4
