"""Prompt tokens the engine's prefix cache served, through a real ``batchgen-server`` process on
the sglang backend over the fake ``sglang`` package, whose bounded radix cache reports
``cached_tokens`` as SGLang does: every output line says its own, the batch's usage sums the
lines, ``/metrics`` counts the same, and a restart keeps the batch's sum, a clean one (from
SQLite) and a kill -9 in the middle of a batch (rebuilt from the lines written).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import TERMINAL, chat_line, file_lines, submit, wait_for_status
from tests.live import LiveServer

SGLANG_FLAGS = ("--backend", "sglang", "--model-path", "fake-model")
#: A long instruction every request shares, as batch jobs do: the part the engine's cache serves.
SYSTEM = "You are a careful assistant. " * 20
METRIC = "batchgen_prefix_cached_tokens_total"


@pytest.fixture
def fake_sglang(fake_sglang_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The fake ``sglang`` for server processes (``fake_sglang_env``); the monkeypatch, to set its knobs."""
    return fake_sglang_env


def _chat(custom_id: str, question: str) -> dict[str, Any]:
    line = chat_line(custom_id, question, max_tokens=6)
    line["body"]["messages"].insert(0, {"role": "system", "content": SYSTEM})
    return line


def _responses(custom_id: str, question: str) -> dict[str, Any]:
    body = {"model": "default", "instructions": SYSTEM, "input": question, "max_output_tokens": 6}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def _cached_tokens(line: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of an output line, whatever its endpoint."""
    usage = line["response"]["body"]["usage"]
    if "input_tokens" in usage:
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _metric(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(METRIC + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {METRIC}")


def _run(client: httpx.Client, lines: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    batch = wait_for_status(client, submit(client, lines)["id"], TERMINAL, timeout_s=60)
    assert batch["status"] == "completed", batch
    return batch, file_lines(client, batch["output_file_id"])


def _assert_the_batch_sums_its_lines(batch: dict[str, Any], lines: list[dict[str, Any]]) -> int:
    counts = [_cached_tokens(line) for line in lines]
    assert all(0 <= cached < prompt for prompt, cached in counts), counts
    total = sum(cached for _, cached in counts)
    assert batch["usage"]["prefix_cached_tokens"] == total
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == total  # no result cache here
    return total


def test_lines_the_batch_and_metrics_agree_and_a_restart_keeps_the_sums(
    fake_sglang: pytest.MonkeyPatch, server_factory: Callable[..., LiveServer]
) -> None:
    server = server_factory(*SGLANG_FLAGS)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert _metric(client) == 0
        first, first_lines = _run(client, [_chat(f"a{i}", f"first question {i}") for i in range(12)])
        first_sum = _assert_the_batch_sums_its_lines(first, first_lines)
        assert _metric(client) == first_sum
        # the second batch shares the first's instruction, which the engine's cache now holds
        second, second_lines = _run(client, [_chat(f"b{i}", f"second question {i}") for i in range(12)])
        second_sum = _assert_the_batch_sums_its_lines(second, second_lines)
        assert all(_cached_tokens(line)[1] > len(SYSTEM.split()) for line in second_lines)
        # /v1/responses lines say it as input_tokens_details.cached_tokens
        third, third_lines = _run(client, [_responses(f"c{i}", f"third question {i}") for i in range(6)])
        third_sum = _assert_the_batch_sums_its_lines(third, third_lines)
        assert third_sum > 0
        assert _metric(client) == first_sum + second_sum + third_sum
    server.stop()
    server = server_factory(*SGLANG_FLAGS)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for batch in (first, second, third):
            assert client.get(f"/v1/batches/{batch['id']}").json()["usage"] == batch["usage"]
        assert _metric(client) == 0  # a new process counts its own work


def _complete_lines(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes() if path.exists() else b""
    return [json.loads(raw) for raw in data[: data.rfind(b"\n") + 1].splitlines()]


def test_a_kill_9_mid_batch_keeps_the_batch_sum_of_its_lines(
    fake_sglang: pytest.MonkeyPatch, server_factory: Callable[..., LiveServer]
) -> None:
    fake_sglang.setenv("FAKE_SGLANG_DELAY_S", "0.02")  # each request takes a while: killed mid-batch
    flags = (*SGLANG_FLAGS, "--max-pool-size", "4", "--fsync-interval-ms", "20")
    server = server_factory(*flags, storage="durable")
    lines = [_chat(f"k{i}", f"question {i}") for i in range(60)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch_id = submit(client, lines)["id"]
    output = server.storage_path / "incremental" / f"{batch_id}.jsonl"
    deadline = time.monotonic() + 60
    while not any(_cached_tokens(line)[1] for line in _complete_lines(output)):  # some lines hit
        assert time.monotonic() < deadline, "no line was served from the engine's cache"
        time.sleep(0.02)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=30)
    before = {line["custom_id"]: line for line in _complete_lines(output)}
    assert 0 < len(before) < len(lines), "the batch finished before the kill; the test proves nothing"

    fake_sglang.delenv("FAKE_SGLANG_DELAY_S")
    server = server_factory(*flags, storage="durable")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        done = wait_for_status(client, batch_id, TERMINAL, timeout_s=60)
        assert done["status"] == "completed", done
        written = file_lines(client, done["output_file_id"])
        after_restart = _metric(client)
    assert sorted(line["custom_id"] for line in written) == sorted(line["custom_id"] for line in lines)
    _assert_the_batch_sums_its_lines(done, written)
    # this process counted only what it ran: the lines written after the restart
    assert after_restart == sum(
        _cached_tokens(line)[1] for line in written if line["custom_id"] not in before
    )
