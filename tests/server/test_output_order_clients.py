"""``output_order`` from every client against a live server: the unchanged ``openai`` SDK through
``extra_body``, both BatchGen clients, and ``batchgen submit --output-order``.

The server runs requests with a per-token latency and lines ask for different ``max_tokens``, so
they finish out of input order; each client's batch must end with its output in input order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import openai
import pytest

from batchgen.client import AsyncBatchGenClient, BatchGenHttpClient
from tests.helpers import chat_line, write_jsonl
from tests.live import LiveServer

FLAGS = ("--simulated-token-latency-s", "0.002", "--max-pool-size", "8")
COUNT = 30


@pytest.fixture
def server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    return server_factory(*FLAGS)


def _input(tmp_path: Path) -> tuple[Path, list[str]]:
    ids = [f"line-{n}" for n in range(COUNT)]
    lines = [chat_line(custom_id, f"q {n}", max_tokens=1 + (n * 7) % 23) for n, custom_id in enumerate(ids)]
    return write_jsonl(tmp_path / "input.jsonl", lines), ids


def _ids(data: bytes) -> list[str]:
    return [json.loads(line)["custom_id"] for line in data.splitlines()]


def test_the_openai_sdk_asks_for_input_order_through_extra_body(server: LiveServer, tmp_path: Path) -> None:
    path, ids = _input(tmp_path)
    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as sdk:
        with path.open("rb") as stream:
            file_id = sdk.files.create(file=stream, purpose="batch").id
        ordered = sdk.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"output_order": "input"},
        )
        assert (ordered.model_extra or {}).get("output_order") == "input"
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.batches.create(
                input_file_id=file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                extra_body={"output_order": "sorted"},
            )
        assert refused.value.body["param"] == "output_order"  # type: ignore[index]
        while ordered.status not in ("completed", "failed", "cancelled", "expired"):
            anyio.run(anyio.sleep, 0.1)
            ordered = sdk.batches.retrieve(ordered.id)
        assert ordered.status == "completed"
        assert ordered.output_file_id is not None
        assert _ids(sdk.files.content(ordered.output_file_id).content) == ids


def test_both_clients_create_and_submit_with_output_order(server: LiveServer, tmp_path: Path) -> None:
    path, ids = _input(tmp_path)
    with BatchGenHttpClient(server.base_url) as client:
        file_id = client.upload_file(path)["id"]
        created = client.create_batch(file_id, output_order="input")
        assert created["output_order"] == "input"
        done = client.wait_for_batch(created["id"], poll_interval=0.1)
        assert _ids(client.download_file_content(done["output_file_id"])) == ids
        completion = client.submit_batch(path, tmp_path / "completion.jsonl", output_order="completion")
        assert completion["output_order"] == "completion"
        appended = _ids((tmp_path / "completion.jsonl").read_bytes())
        assert sorted(appended) == sorted(ids) and appended != ids  # they did finish out of order

    async def asynchronous() -> None:
        async with AsyncBatchGenClient(server.base_url) as client:
            created = await client.create_batch((await client.upload_file(path))["id"], output_order="input")
            assert created["output_order"] == "input"
            await client.wait_for_batch(created["id"], poll_interval=0.1)
            batch = await client.submit_batch(
                path, tmp_path / "async.jsonl", output_order="input", progress=False
            )
            assert batch["output_order"] == "input"

    anyio.run(asynchronous)
    assert _ids((tmp_path / "async.jsonl").read_bytes()) == ids


def test_batchgen_submit_output_order_input(server: LiveServer, tmp_path: Path) -> None:
    path, ids = _input(tmp_path)
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "batchgen.client.cli", "--base-url", server.base_url]
    result = subprocess.run(
        [*command, "submit", str(path), "-o", str(out), "--output-order", "input", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["output_order"] == "input"
    assert _ids(out.read_bytes()) == ids
    refused = subprocess.run(
        [*command, "submit", str(path), "-o", str(out), "--output-order", "sorted"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--output-order" in refused.stderr


def test_follow_results_yields_each_line_of_an_ordered_batch_once(server: LiveServer, tmp_path: Path) -> None:
    path, ids = _input(tmp_path)
    with BatchGenHttpClient(server.base_url) as client:
        created = client.create_batch(client.upload_file(path)["id"], output_order="input")
        followed = [
            json.loads(line)["custom_id"] for line in client.follow_results(created["id"], poll_interval=0.05)
        ]
        done = client.get_batch(created["id"])
        assert _ids(client.download_file_content(done["output_file_id"])) == ids
    assert sorted(followed) == sorted(ids)
