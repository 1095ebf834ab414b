"""``batchgen-server --backend vllm``: the real vLLM engine behind the real server on 127.0.0.1.

A batch of chat, completions and ``/v1/responses`` lines, sent with the official ``openai`` SDK,
comes back with one line per request, each with vLLM's answer (several choices, logprobs,
structured output, the prefix cache's ``cached_tokens``). Exactly-once holds across a kill -9 of
vLLM's engine core process mid-batch (the backend starts a new engine and sends it the requests
that were running) and across a kill -9 of the server itself (the restarted server resumes the
batch; the killed server's engine processes do not outlive it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from batchgen.core.backends.process_reaper import descendants
from tests.helpers import chat_line, file_lines, jsonl, submit, wait_for_status
from tests.live import LiveServer, start_server

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.live]

#: A vLLM engine takes 20-40 s to start on two cores, more on a busy machine.
START_S = 300.0
ENGINE_CORE = "VLLM::EngineCore"


def _vllm_server(storage: Path, model: Path, *flags: str) -> LiveServer:
    return start_server(
        storage,
        "--backend",
        "vllm",
        "--model",
        str(model),
        "--kv-cache-gib",
        "0.5",
        *flags,
        timeout_s=START_S,
    )


@pytest.fixture
def servers() -> Iterator[list[LiveServer]]:
    started: list[LiveServer] = []
    yield started
    for server in started:
        server.stop()


def _engine_cores_of(pid: int) -> list[int]:
    """vLLM's engine core processes among the descendants of ``pid``."""
    return descendants(pid, ENGINE_CORE)


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _wait_for_first_completion(client: httpx.Client, batch_id: str) -> None:
    deadline = time.monotonic() + 180
    while client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] == 0:
        assert time.monotonic() < deadline, "no request finished"
        time.sleep(0.05)


def _wait_for_a_replacement_engine(client: httpx.Client, server_pid: int, dead: int) -> None:
    """Until the server has an engine core other than ``dead`` and says it is healthy."""
    deadline = time.monotonic() + START_S
    while not (_engine_cores_of(server_pid) not in ([], [dead]) and client.get("/health").status_code == 200):
        assert time.monotonic() < deadline, f"no new engine core answered within {START_S:.0f} s"
        time.sleep(0.2)


def test_a_batch_sent_with_the_openai_sdk_runs_on_vllm(
    servers: list[LiveServer], tiny_vllm_model: Path, tmp_path: Path
) -> None:
    server = _vllm_server(tmp_path / "storage", tiny_vllm_model)
    servers.append(server)
    long = " ".join(f"item{n}" for n in range(100))
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    lines: list[dict[str, Any]] = [
        chat_line("plain", "Hello there", max_tokens=6),
        chat_line("choices", "Name three colours", max_tokens=4, n=2),
        chat_line("logprobs", "Count to five", max_tokens=4, logprobs=True, top_logprobs=2),
        chat_line(
            "json",
            "Is the sea blue?",
            max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
        ),
        chat_line("prefix-1", long, max_tokens=2),
        chat_line("prefix-2", long, max_tokens=2),
    ]
    sdk = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
    uploaded = sdk.files.create(file=("batch.jsonl", jsonl(*lines)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == len(lines)
    assert batch.output_file_id is not None
    output = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in output}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines) and len(output) == len(lines)
    bodies = {custom_id: line["response"]["body"] for custom_id, line in by_id.items()}
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in output)
    assert bodies["plain"]["usage"]["completion_tokens"] == 6  # the tiny model has no end token
    assert [choice["index"] for choice in bodies["choices"]["choices"]] == [0, 1]
    assert bodies["choices"]["usage"]["completion_tokens"] == 8
    content = bodies["logprobs"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    verdict = bodies["json"]["choices"][0]
    assert verdict["finish_reason"] == "stop"
    assert json.loads(verdict["message"]["content"])["answer"] in ("yes", "no")
    cached = [
        bodies[name]["usage"]["prompt_tokens_details"]["cached_tokens"] for name in ("prefix-1", "prefix-2")
    ]
    prompt = bodies["prefix-2"]["usage"]["prompt_tokens"]
    # whichever ran second found the prompt's whole blocks in the cache (vLLM caches full blocks)
    assert prompt // 2 <= max(cached) < prompt, cached
    total = sum(body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in bodies.values())
    assert batch.usage is not None
    assert batch.usage.input_tokens_details.cached_tokens == total


def test_a_killed_engine_core_is_replaced_and_each_request_has_one_line(
    servers: list[LiveServer], tiny_vllm_model: Path, tmp_path: Path
) -> None:
    # four requests at a time, so that the first to finish leaves others running and queued
    server = _vllm_server(tmp_path / "storage", tiny_vllm_model, "--max-pool-size", "4")
    servers.append(server)
    [engine] = _engine_cores_of(server.process.pid)
    lines = [chat_line(f"q{n}", f"Question {n}", max_tokens=1000) for n in range(16)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch = submit(client, lines)
        _wait_for_first_completion(client, batch["id"])
        os.kill(engine, signal.SIGKILL)  # mid-batch: some requests done, some running, some queued
        counts = client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]
        assert counts["completed"] < 16, "the batch ended before the kill"
        # two waits, each with a start's deadline: a new engine (as slow to start as the first on a
        # busy machine), then the twelve or so requests it runs again and the ones still queued
        _wait_for_a_replacement_engine(client, server.process.pid, engine)
        done = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=START_S)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
        output = file_lines(client, done["output_file_id"])
        health = client.get("/health")
        assert health.status_code == 200, health.text
    assert Counter(line["custom_id"] for line in output) == Counter(f"q{n}" for n in range(16))
    assert all(line["error"] is None for line in output)
    for line in output:  # to the limit, or to the end token the random model may emit (vLLM stops there)
        [choice] = line["response"]["body"]["choices"]
        tokens = line["response"]["body"]["usage"]["completion_tokens"]
        assert (choice["finish_reason"], tokens) == ("length", 1000) or (
            choice["finish_reason"] == "stop" and tokens < 1000
        ), line
    assert _gone(engine)
    [replacement] = _engine_cores_of(server.process.pid)
    assert replacement != engine
    assert "restarting" in server.log_path.read_text()


def test_a_killed_server_leaves_no_engine_behind_and_its_restart_finishes_the_batch(
    servers: list[LiveServer], tiny_vllm_model: Path, tmp_path: Path
) -> None:
    storage = tmp_path / "storage"
    first = _vllm_server(storage, tiny_vllm_model, "--max-pool-size", "4")
    servers.append(first)
    engines = _engine_cores_of(first.process.pid)
    lines = [chat_line(f"q{n}", f"Question {n}", max_tokens=1000) for n in range(16)]
    with httpx.Client(base_url=first.base_url, timeout=30) as client:
        batch = submit(client, lines)
        _wait_for_first_completion(client, batch["id"])
        counts = client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]
        first.process.send_signal(signal.SIGKILL)
        assert counts["completed"] < 16, "the batch ended before the kill"
    first.process.wait(timeout=30)
    assert engines and all(_gone(engine) for engine in engines), "an engine process outlived its server"
    second = _vllm_server(storage, tiny_vllm_model)
    servers.append(second)
    with httpx.Client(base_url=second.base_url, timeout=30) as client:
        done = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=START_S)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
        output = file_lines(client, done["output_file_id"])
    assert Counter(line["custom_id"] for line in output) == Counter(f"q{n}" for n in range(16))
    assert all(line["error"] is None for line in output)
