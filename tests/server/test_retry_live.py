"""Retries in real ``batchgen-server`` processes: kill -9 while a retry batch is being made and
while it runs leaves no half-made retry and every request exactly once in the merged view; the
unchanged ``openai`` SDK reads retry batches and their new fields."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.helpers import TERMINAL, chat_line, create_batch, upload, wait_for_status, write_jsonl
from tests.live import LiveServer

#: Per attempt (3 attempts): about 30% of lines end failed. Fast requests, frequent fsyncs.
FLAGS = (
    "--simulated-failure-rate",
    "0.67",
    "--simulated-latency-s",
    "0.01",
    "--max-pool-size",
    "16",
    "--fsync-interval-ms",
    "50",
)


def _rows_retrying(storage: Path, batch_id: str) -> list[str]:
    """The batches the database holds as retries of ``batch_id``, oldest first."""
    with sqlite3.connect(storage / "metadata.sqlite3") as db:
        rows = db.execute("SELECT id FROM batches WHERE retry_of = ? ORDER BY seq", [batch_id]).fetchall()
    return [row[0] for row in rows]


def _post_in_background(base_url: str, path: str, key: str) -> None:
    def post() -> None:
        with contextlib.suppress(httpx.HTTPError):  # killed under it
            httpx.post(base_url + path, json={}, headers={"Idempotency-Key": key}, timeout=30)

    threading.Thread(target=post, daemon=True).start()


def _check_no_half_made_retry(client: httpx.Client, storage: Path, original: str) -> list[str]:
    """Every retry the store holds is a whole batch, served and listed on the original."""
    retries = client.get(f"/v1/batches/{original}").json()["retries"]
    assert retries == _rows_retrying(storage, original)
    for retry_id in retries:
        retry = client.get(f"/v1/batches/{retry_id}").json()
        assert retry["retry_of"] == original
        content = client.get(f"/v1/files/{retry['input_file_id']}/content")
        assert content.status_code == 200
        assert len(content.content.splitlines()) == retry["request_counts"]["total"] > 0
    # and no retry's input file without its batch: the two are written together
    inputs = [
        file
        for file in client.get("/v1/files").json()["data"]
        if file["filename"] == f"{original}_retry.jsonl"
    ]
    assert sorted(file["id"] for file in inputs) == sorted(
        client.get(f"/v1/batches/{retry_id}").json()["input_file_id"] for retry_id in retries
    )
    return list(retries)


def test_kill_9_while_a_retry_is_made_or_runs_leaves_whole_retries_and_exactly_once(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    total = 1500
    lines = [chat_line(f"k{i}", f"prompt {i}") for i in range(total)]
    input_path = write_jsonl(tmp_path / "in.jsonl", lines)
    rng = random.Random(22)
    server = server_factory(*FLAGS, storage="kept")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        original = create_batch(client, upload(client, input_path)["id"])["id"]
        wait_for_status(client, original, {"completed"}, timeout_s=120)
    for round_number in range(8):
        key = f"round-{round_number}"
        _post_in_background(server.base_url, f"/v1/batches/{original}/retry", key)
        time.sleep(rng.uniform(0.0, 0.08))  # while the retry is made, or early in its run
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        server = server_factory(*FLAGS, storage="kept")
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            before = _check_no_half_made_retry(client, server.storage_path, original)
            # the same key again: the retry the killed call made, if it made one, else a new one
            response = client.post(f"/v1/batches/{original}/retry", json={}, headers={"Idempotency-Key": key})
            if response.status_code == 409 and response.json()["error"]["code"] == "nothing_to_retry":
                break
            if response.status_code == 409:  # the killed call's retry, resumed, still runs
                assert response.json()["error"]["code"] == "batch_not_final"
                wait_for_status(client, before[-1], TERMINAL, timeout_s=120)
                response = client.post(
                    f"/v1/batches/{original}/retry", json={}, headers={"Idempotency-Key": key}
                )
            assert response.status_code == 200, response.text
            retry_id = response.json()["id"]
            after = _check_no_half_made_retry(client, server.storage_path, original)
            assert after[-1] == retry_id and after[:-1] == [b for b in before if b != retry_id]
            assert len(after) - len(before) in (0, 1)
            if rng.random() < 0.5:  # kill it while it runs, too
                time.sleep(rng.uniform(0.0, 0.2))
                server.process.send_signal(signal.SIGKILL)
                server.process.wait(timeout=30)
                server = server_factory(*FLAGS, storage="kept")
            with httpx.Client(base_url=server.base_url, timeout=30) as client2:
                wait_for_status(client2, retry_id, TERMINAL, timeout_s=120)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        while True:
            response = client.post(f"/v1/batches/{original}/retry", json={})
            if response.status_code == 409:
                assert response.json()["error"]["code"] == "nothing_to_retry", response.text
                break
            wait_for_status(client, response.json()["id"], TERMINAL, timeout_s=120)
        _check_no_half_made_retry(client, server.storage_path, original)
        merged = client.get(f"/v1/batches/{original}/merged_results")
        records = [json.loads(line) for line in merged.content.splitlines()]
        ids = [record["custom_id"] for record in records]
        assert ids == [line["custom_id"] for line in lines], "every request exactly once, in input order"
        assert all(record["error"] is None for record in records)
        # each retry's own output holds each of its requests exactly once, across the kills
        for retry_id in _rows_retrying(server.storage_path, original):
            output = server.storage_path / "incremental" / f"{retry_id}.jsonl"
            retry_ids = [json.loads(line)["custom_id"] for line in output.read_bytes().splitlines()]
            assert len(retry_ids) == len(set(retry_ids))


def test_the_openai_sdk_reads_retry_batches(live_server: LiveServer, tmp_path: Path) -> None:
    long_prompt = "word " * 10_000  # over the simulated context: an error line on every attempt
    path = write_jsonl(tmp_path / "in.jsonl", [chat_line("fine"), chat_line("too-long", long_prompt)])
    with openai.OpenAI(base_url=live_server.api_url, api_key="unused", max_retries=0) as sdk:
        with path.open("rb") as stream:
            file_id = sdk.files.create(file=stream, purpose="batch").id
        batch = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with httpx.Client(base_url=live_server.base_url, timeout=30) as client:
            wait_for_status(client, batch.id, TERMINAL)
            made: dict[str, Any] = client.post(f"/v1/batches/{batch.id}/retry", json={}).json()
            wait_for_status(client, made["id"], TERMINAL)
        retry = sdk.batches.retrieve(made["id"])
        assert retry.id == made["id"] and retry.status in TERMINAL
        assert retry.input_file_id == made["input_file_id"]
        assert retry.request_counts is not None and retry.request_counts.total == 1
        assert (retry.model_extra or {})["retry_of"] == batch.id
        original = sdk.batches.retrieve(batch.id)
        assert (original.model_extra or {})["retries"] == [retry.id]
        listed = {item.id: item for item in sdk.batches.list(limit=100)}
        assert (listed[retry.id].model_extra or {})["retry_of"] == batch.id
        assert sdk.files.content(retry.input_file_id).content.splitlines() == [
            path.read_bytes().splitlines()[1]
        ]
