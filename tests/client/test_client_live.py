"""The Python client against a live server: the guide's one-liner, step by step, and 429 retries."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest

from batchgen.batchgen_client import AsyncBatchGenClient, BatchGenHttpClient
from batchgen.client import RetryPolicy
from tests.live import LiveServer, chat_line, write_jsonl


def test_submit_batch_one_liner(live_server: LiveServer, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(30)])
    with BatchGenHttpClient(live_server.base_url) as client:
        batch = client.submit_batch(
            input_file_path=str(tmp_path / "input.jsonl"),
            output_file_path=str(tmp_path / "output.jsonl"),
            max_decoding_length=16,
            poll_interval=0.1,
        )
    assert batch["status"] == "completed"
    assert batch["max_decoding_length"] == 16
    lines = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"request-{i}" for i in range(30))
    assert all(line["response"]["body"]["usage"]["completion_tokens"] <= 16 for line in lines)


def test_step_by_step_as_in_the_guide(live_server: LiveServer, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(5)])
    client = BatchGenHttpClient(live_server.base_url)
    file_obj = client.upload_file(str(tmp_path / "input.jsonl"), purpose="batch")
    batch = client.create_batch(
        input_file_id=file_obj["id"],
        endpoint="/v1/chat/completions",
        max_decoding_length=4096,
        temperature=0.7,
    )
    assert batch["temperature"] == 0.7
    batch = client.wait_for_batch(batch["id"], poll_interval=0.1)
    content = client.download_file_content(batch["output_file_id"])
    assert len(content.splitlines()) == 5
    client.close()


def test_create_batch_retries_429_using_retry_after(server_factory, tmp_path: Path) -> None:
    server = server_factory(
        "--max-intake-capacity", "6", "--max-pool-size", "2", "--simulated-latency-s", "0.25"
    )
    waits: list[float] = []

    def short_sleep(seconds: float) -> None:
        waits.append(seconds)
        time.sleep(min(seconds, 0.3))

    write_jsonl(tmp_path / "a.jsonl", [chat_line(f"a{i}") for i in range(6)])
    write_jsonl(tmp_path / "b.jsonl", [chat_line(f"b{i}") for i in range(6)])
    with BatchGenHttpClient(server.base_url, retry=RetryPolicy(sleep=short_sleep)) as client:
        first = client.create_batch(client.upload_file(str(tmp_path / "a.jsonl"))["id"])
        second_file = client.upload_file(str(tmp_path / "b.jsonl"))["id"]
        second = client.create_batch(second_file)  # 429 until the first batch drains
        assert waits and all(wait == 30 for wait in waits), waits  # the server's Retry-After, not backoff
        assert client.wait_for_batch(first["id"], poll_interval=0.1)["status"] == "completed"
        assert client.wait_for_batch(second["id"], poll_interval=0.1)["status"] == "completed"
        assert len(client.list_batches()["data"]) == 2, "a retried create must not make a second batch"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_client_runs_several_batches_at_once(live_server: LiveServer, tmp_path: Path) -> None:
    async with AsyncBatchGenClient(live_server.base_url) as client:
        results: dict[int, dict] = {}

        async def run(n: int) -> None:
            path = write_jsonl(tmp_path / f"in-{n}.jsonl", [chat_line(f"{n}-{i}") for i in range(10)])
            results[n] = await client.submit_batch(
                str(path), str(tmp_path / f"out-{n}.jsonl"), poll_interval=0.1
            )

        async with anyio.create_task_group() as tasks:
            for n in range(4):
                tasks.start_soon(run, n)
    assert {n: batch["status"] for n, batch in results.items()} == {n: "completed" for n in range(4)}
    assert all(len((tmp_path / f"out-{n}.jsonl").read_text().splitlines()) == 10 for n in range(4))
