"""Retrying what did not succeed from both clients and the `batchgen` command, against a live
server whose simulated engine fails about 30% of requests for good (0.67 per attempt, 3 attempts),
and whose context is 50 tokens, so that a long prompt fails in a way no retry can fix."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchgen.client import APIStatusError, AsyncBatchGenClient, BatchGenHttpClient
from tests.live import LiveServer, chat_line, start_server, write_jsonl

pytestmark = pytest.mark.live

FLAGS = ("--simulated-failure-rate", "0.67", "--max-pool-size", "32", "--max-context-length", "50")
#: A prompt of more than the servers' 50 tokens: context_length_exceeded on every attempt.
LONG_PROMPT = " ".join(["word"] * 80)


@pytest.fixture(scope="module")
def steady_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server that fails nothing but prompts past its 50-token context."""
    live = start_server(tmp_path_factory.mktemp("retry-steady") / "storage", "--max-context-length", "50")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("retry-client") / "storage", *FLAGS)
    yield live
    live.stop()


def _input(path: Path, n: int = 200) -> list[str]:
    ids = [f"c{i}" for i in range(n)]
    write_jsonl(path, [chat_line(custom_id, f"question {custom_id}") for custom_id in ids])
    return ids


def _records(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines()]


def _one_success_each(records: list[dict[str, Any]], ids: list[str]) -> None:
    assert [record["custom_id"] for record in records] == ids
    assert all(record["error"] is None and record["response"]["status_code"] == 200 for record in records)


def batchgen(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchgen.client.cli", "--base-url", server.base_url, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_submit_with_retry_failed_writes_one_success_per_request(server: LiveServer, tmp_path: Path) -> None:
    ids = _input(tmp_path / "in.jsonl")
    with BatchGenHttpClient(server.base_url) as client:
        batch = client.submit_batch(
            tmp_path / "in.jsonl", tmp_path / "out.jsonl", poll_interval=0.05, retry_failed=20
        )
        assert batch["request_counts"]["failed"] > 0, "nothing failed: the test proves nothing"
        assert batch["retries"], "submit made no retry"
        for retry_id in batch["retries"]:
            assert client.get_batch(retry_id)["retry_of"] == batch["id"]
        _one_success_each(_records((tmp_path / "out.jsonl").read_bytes()), ids)
        assert client.download_merged_results(batch["id"]) == (tmp_path / "out.jsonl").read_bytes()
        with pytest.raises(APIStatusError) as refused:
            client.retry_batch(batch["id"])
        assert refused.value.status_code == 409 and refused.value.code == "nothing_to_retry"
        with pytest.raises(ValueError, match="error_file_path"):
            client.submit_batch(
                tmp_path / "in.jsonl", tmp_path / "o.jsonl", error_file_path="e", retry_failed=1
            )


def test_the_async_client_retries_and_reads_the_merged_results(server: LiveServer, tmp_path: Path) -> None:
    ids = _input(tmp_path / "in.jsonl")

    async def run() -> tuple[dict[str, Any], bytes, Path]:
        async with AsyncBatchGenClient(server.base_url) as client:
            file = await client.upload_file(tmp_path / "in.jsonl")
            batch = await client.create_batch(file["id"], metadata={"team": "a"})
            batch = await client.wait_for_batch(batch["id"], poll_interval=0.05)
            while True:
                try:
                    retry = await client.retry_batch(batch["id"], ["failed", "not_run"], idempotency_key=None)
                except APIStatusError as exc:
                    assert exc.code == "nothing_to_retry"
                    break
                assert retry["retry_of"] == batch["id"] and retry["metadata"] == {"team": "a"}
                await client.wait_for_batch(retry["id"], poll_interval=0.05)
            merged = await client.download_merged_results(batch["id"])
            path = await client.download_merged_results_to(batch["id"], tmp_path / "merged.jsonl")
            return await client.get_batch(batch["id"]), merged, path

    batch, merged, path = asyncio.run(run())
    assert batch["retries"]
    _one_success_each(_records(merged), ids)
    assert path.read_bytes() == merged
    async_submit = asyncio.run(_async_submit(server, tmp_path))
    assert async_submit["retries"]
    _one_success_each(_records((tmp_path / "async-out.jsonl").read_bytes()), ids)


async def _async_submit(server: LiveServer, tmp_path: Path) -> dict[str, Any]:
    async with AsyncBatchGenClient(server.base_url) as client:
        return await client.submit_batch(
            tmp_path / "in.jsonl", tmp_path / "async-out.jsonl", poll_interval=0.05, retry_failed=20
        )


def test_the_command_retries_with_submit_and_with_retry(server: LiveServer, tmp_path: Path) -> None:
    ids = _input(tmp_path / "in.jsonl")
    done = batchgen(
        server, "submit", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
        "--retry-failed", "20", "--poll-interval", "0.05", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    batch = json.loads(done.stdout)
    assert batch["retries"] and re.search(r"\b\d+ retr(y|ies) made", done.stderr), done.stderr
    _one_success_each(_records((tmp_path / "out.jsonl").read_bytes()), ids)

    with BatchGenHttpClient(server.base_url) as client:
        first = client.submit_batch(tmp_path / "in.jsonl", poll_interval=0.05)
    shown = batchgen(server, "retry", first["id"], "--only", "failed", "--temperature", "0.5")
    assert shown.returncode == 0, shown.stderr
    retry = json.loads(shown.stdout)
    assert retry["retry_of"] == first["id"] and retry["temperature"] == 0.5
    assert retry["request_counts"]["total"] == first["request_counts"]["failed"]
    with BatchGenHttpClient(server.base_url) as client:
        client.wait_for_batch(retry["id"], poll_interval=0.05)
    for _ in range(20):
        waited = batchgen(
            server, "retry", first["id"], "-o", str(tmp_path / "merged.jsonl"), "--poll-interval", "0.05", "--no-progress"
        )  # fmt: skip
        if waited.returncode == 3:
            assert "nothing_to_retry" in waited.stderr or "Nothing to retry" in waited.stderr, waited.stderr
            break
        assert waited.returncode == 0, waited.stderr
        assert json.loads(waited.stdout)["retry_of"] == first["id"]
    downloaded = batchgen(server, "download", first["id"], "--merged", "-o", str(tmp_path / "again.jsonl"))
    assert downloaded.returncode == 0, downloaded.stderr
    _one_success_each(_records((tmp_path / "again.jsonl").read_bytes()), ids)
    if (tmp_path / "merged.jsonl").exists():  # written by the last `retry -o` that made a retry
        assert (tmp_path / "merged.jsonl").read_bytes() == (tmp_path / "again.jsonl").read_bytes()
    usage = batchgen(
        server, "submit", str(tmp_path / "in.jsonl"), "-o", "o", "--error-output", "e", "--retry-failed", "1"
    )
    assert usage.returncode == 2 and "--retry-failed" in usage.stderr
    assert "--retry-failed" in batchgen(server, "submit", "--help").stdout
    assert "merged" in batchgen(server, "retry", "--help").stdout


def test_a_line_no_retry_can_fix_is_not_retried_and_the_command_exits_non_zero(
    steady_server: LiveServer, tmp_path: Path
) -> None:
    lines = [chat_line("short-1", "a short question"), chat_line("too-long", LONG_PROMPT)]
    write_jsonl(tmp_path / "in.jsonl", [*lines, chat_line("short-2", "another one")])
    done = batchgen(
        steady_server, "submit", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
        "--retry-failed", "3", "--poll-interval", "0.05", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 6, done.stderr
    batch = json.loads(done.stdout)
    assert batch["retries"] == [] and batch["request_counts"]["failed"] == 1
    assert "batchgen: 0 retries made;" in done.stderr, done.stderr
    assert (
        "batchgen: 1 request failed: 1 request with an error no retry can fix (context_length_exceeded: 1)"
        in done.stderr
    ), done.stderr
    records = {record["custom_id"]: record for record in _records((tmp_path / "out.jsonl").read_bytes())}
    assert records["too-long"]["error"]["code"] == "context_length_exceeded"
    with BatchGenHttpClient(steady_server.base_url) as client:
        made = [
            listed["id"] for listed in client.list_batches()["data"] if listed.get("retry_of") == batch["id"]
        ]
    assert made == [], "a retry was made of a line no retry can fix"
    assert (
        "6 " in batchgen(steady_server, "submit", "--help").stdout + batchgen(steady_server, "--help").stdout
    )


def test_retries_stop_once_only_failures_no_retry_can_fix_are_left(
    server: LiveServer, tmp_path: Path
) -> None:
    ids = _input(tmp_path / "in.jsonl", 100)
    with (tmp_path / "in.jsonl").open("a") as lines:
        lines.write(json.dumps(chat_line("too-long", LONG_PROMPT)) + "\n")
    done = batchgen(
        server, "submit", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
        "--retry-failed", "20", "--poll-interval", "0.05", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 6, done.stderr
    batch = json.loads(done.stdout)
    # the transient failures are gone within a few rounds; the long line alone would retry 20 times
    assert 0 < len(batch["retries"]) < 20, done.stderr
    assert "1 request with an error no retry can fix (context_length_exceeded: 1)" in done.stderr, done.stderr
    records = _records((tmp_path / "out.jsonl").read_bytes())
    _one_success_each(records[:-1], ids)
    assert (
        records[-1]["custom_id"] == "too-long" and records[-1]["error"]["code"] == "context_length_exceeded"
    )
