"""Both clients' `upload_file_chunked`, and `submit_batch` / `batchgen submit` switching to the
Uploads API past `chunked_upload_threshold`, against live servers. The server is started with a
one-shot upload limit below the file's size, so only the Uploads API can take the file."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from batchgen.client import APIStatusError, AsyncBatchGenClient, BatchGenHttpClient
from tests.live import LiveServer, chat_line, write_jsonl

LIMIT = 4000  # --max-upload-bytes: a plain POST /v1/files of more is a 413


@pytest.fixture
def small_limit_server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    return server_factory("--max-upload-bytes", str(LIMIT))


def _input(tmp_path: Path, count: int = 120) -> Path:
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"c-{i}", f"question {i}") for i in range(count)])
    assert path.stat().st_size > 2 * LIMIT
    return path


def test_the_sync_client_uploads_in_parts_past_the_one_shot_limit(
    small_limit_server: LiveServer, tmp_path: Path
) -> None:
    path = _input(tmp_path)
    with BatchGenHttpClient(small_limit_server.base_url) as client:
        with pytest.raises(APIStatusError) as refused:
            client.upload_file(path)
        assert refused.value.status_code == 413
        upload = client.upload_file_chunked(path, part_size=1001)
        assert upload["status"] == "completed" and upload["bytes"] == path.stat().st_size
        file = upload["file"]
        assert client.download_file_content(file["id"]) == path.read_bytes()
        assert client.create_batch(file["id"])["request_counts"]["total"] == 120


def test_the_async_client_uploads_in_parts(small_limit_server: LiveServer, tmp_path: Path) -> None:
    path = _input(tmp_path)

    async def run() -> tuple[dict[str, object], bytes]:
        async with AsyncBatchGenClient(small_limit_server.base_url) as client:
            upload = await client.upload_file_chunked(path, part_size=3333, md5=False)
            file = upload["file"]
            assert isinstance(file, dict)
            return upload, await client.download_file_content(file["id"])

    upload, content = anyio.run(run)
    assert upload["status"] == "completed" and content == path.read_bytes()


def test_submit_batch_switches_to_the_uploads_api_past_the_threshold(
    small_limit_server: LiveServer, tmp_path: Path
) -> None:
    path = _input(tmp_path)
    with BatchGenHttpClient(small_limit_server.base_url) as client:
        with pytest.raises(APIStatusError):  # under the default threshold: one POST /v1/files, 413
            client.submit_batch(path, tmp_path / "no.jsonl", poll_interval=0.05)
        batch = client.submit_batch(
            path, tmp_path / "out.jsonl", poll_interval=0.05, chunked_upload_threshold=LIMIT
        )
    assert batch["status"] == "completed"
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"c-{i}" for i in range(120))


def test_batchgen_submit_with_a_chunked_upload_threshold(
    small_limit_server: LiveServer, tmp_path: Path
) -> None:
    path = _input(tmp_path)
    out = tmp_path / "out.jsonl"
    base = [sys.executable, "-m", "batchgen.client.cli", "submit", str(path), "-o", str(out)]
    common = ["--poll-interval", "0.05", "--no-progress", "--base-url", small_limit_server.base_url]
    plain = subprocess.run([*base, *common], capture_output=True, text=True, timeout=60)
    assert plain.returncode != 0 and "413" in plain.stderr
    chunked = subprocess.run(
        [*base, "--chunked-upload-threshold", str(LIMIT), *common], capture_output=True, text=True, timeout=60
    )
    assert chunked.returncode == 0, chunked.stderr
    assert json.loads(chunked.stdout)["status"] == "completed"
    assert len(out.read_text().splitlines()) == 120
