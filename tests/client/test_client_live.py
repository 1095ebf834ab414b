"""The Python client against a live server: the guide's one-liner, step by step, several batches
at once, retries (429 from a full intake pool; 503, an HTTP-date Retry-After and a lost response
through a flaky proxy; a server that is down and then comes up), the Idempotency-Key, a streamed
download of a large output, and following results while a batch runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import formatdate
from pathlib import Path

import anyio
import pytest

from batchgen.batchgen_client import AsyncBatchGenClient, BatchGenHttpClient
from batchgen.client import APIStatusError, RetryPolicy
from tests.client.flaky_proxy import DROP_AFTER_FORWARDING, FlakyProxy, Reply
from tests.live import LiveServer, chat_line, free_port, write_jsonl


class Waits(list[float]):
    """A `RetryPolicy.sleep` that records each wait and really sleeps at most `cap` seconds."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def __call__(self, seconds: float) -> None:
        self.append(seconds)
        time.sleep(min(seconds, self.cap))

    def retries(self, poll_interval: float) -> list[float]:
        """The waits that were not polls of `wait_for_batch`."""
        return [wait for wait in self if wait != poll_interval]


def batches_over(client: BatchGenHttpClient, file_id: str) -> list[dict]:
    return [b for b in client.list_batches(limit=100)["data"] if b["input_file_id"] == file_id]


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
        # The server's Retry-After (whole seconds from its drain rate, 1..300), not jittered backoff.
        assert waits and all(wait == int(wait) and 1 <= wait <= 300 for wait in waits), waits
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


# --- retries: 503, HTTP-date Retry-After, a server that is down and then comes up -----------------


def test_503_is_retried_and_a_retried_upload_sends_the_whole_file(
    live_server: LiveServer, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(500)])
    waits = Waits(cap=0.05)
    with FlakyProxy(live_server.base_url) as proxy:
        proxy.fail("POST", "/v1/files", Reply(503), Reply(503))
        proxy.fail("POST", "/v1/batches", Reply(503))
        with BatchGenHttpClient(proxy.base_url, retry=RetryPolicy(sleep=waits)) as client:
            batch = client.submit_batch(path, tmp_path / "output.jsonl", poll_interval=0.05)
            assert len(batches_over(client, batch["input_file_id"])) == 1
    assert batch["status"] == "completed"
    assert waits.retries(0.05) == [1, 2, 1]  # the guide's schedule, restarted for each call
    uploads = proxy.seen("POST", "/v1/files")
    assert [u.answer for u in uploads] == ["503", "503", "forwarded"]
    assert all(path.read_bytes() in u.body for u in uploads)  # each attempt sent the whole file
    assert len({u.headers["Idempotency-Key"] for u in uploads}) == 1
    creates = proxy.seen("POST", "/v1/batches")
    assert [c.answer for c in creates] == ["503", "forwarded"]
    assert len({c.headers["Idempotency-Key"] for c in creates}) == 1
    assert len((tmp_path / "output.jsonl").read_text().splitlines()) == 500


def test_retry_after_as_an_http_date(live_server: LiveServer) -> None:
    waits = Waits(cap=3.0)
    with FlakyProxy(live_server.base_url) as proxy:
        when = formatdate(time.time() + 2, usegmt=True)  # whole seconds: 1 to 2 s from now
        proxy.fail("GET", "/v1/pool/status", Reply(429, {"Retry-After": when}))
        started = time.monotonic()
        with BatchGenHttpClient(proxy.base_url, retry=RetryPolicy(sleep=waits)) as client:
            status = client.pool_status()
        elapsed = time.monotonic() - started
    assert "intake_pool_capacity" in status
    assert len(waits) == 1 and 0.5 <= waits[0] <= 2.0, waits  # the date, not the 1 s backoff
    assert elapsed >= waits[0]
    assert [r.answer for r in proxy.requests] == ["429", "forwarded"]


@contextmanager
def server_started_later(port: int, storage_path: Path, delay: float) -> Iterator[None]:
    """Start a server on `port` in a thread after `delay` seconds; stop it on leaving."""
    started: list[subprocess.Popen[bytes]] = []

    def launch() -> None:
        time.sleep(delay)
        storage_path.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "batchgen.server.cli", "--port", str(port)]
        command += ["--storage-path", str(storage_path), "--backend", "simulated", "--log-level", "warning"]
        log = open(storage_path.parent / "late-server.log", "wb")  # noqa: SIM115 - the child's
        started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()))

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
        for process in started:
            process.terminate()
            process.wait(timeout=15)


def test_server_down_then_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(20)])
    waits = Waits(cap=1.0)
    policy = RetryPolicy(base_delay=0.25, multiplier=1.5, max_delay=1.0, max_retries=30, sleep=waits)
    with (
        server_started_later(port, tmp_path / "storage", delay=1.0),
        caplog.at_level(logging.INFO, logger="batchgen.client"),
        BatchGenHttpClient(f"http://127.0.0.1:{port}", retry=policy) as client,
    ):
        # Sent at once: refused until the server is up, then upload → create → wait → download.
        batch = client.submit_batch(path, tmp_path / "output.jsonl", poll_interval=0.05)
    assert batch["status"] == "completed"
    assert len((tmp_path / "output.jsonl").read_text().splitlines()) == 20
    refused = [r.getMessage() for r in caplog.records if "ConnectError" in r.getMessage()]
    assert refused and all(m.startswith("POST /v1/files failed") for m in refused), refused
    assert sum(waits.retries(0.05)) >= 0.9  # it did wait for the server


# --- Idempotency-Key: no second batch after a retried create -------------------------------------
# These need the server's Idempotency-Key support (same key + same body → the same batch; same key
# + a different body → 409).


def test_same_idempotency_key_twice_makes_one_batch(live_server: LiveServer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(3)])
    with BatchGenHttpClient(live_server.base_url) as client:
        file_id = client.upload_file(path)["id"]
        key = str(uuid.uuid4())
        first = client.create_batch(file_id, max_decoding_length=8, idempotency_key=key)
        second = client.create_batch(file_id, max_decoding_length=8, idempotency_key=key)
        assert second["id"] == first["id"]
        assert [b["id"] for b in batches_over(client, file_id)] == [first["id"]]


def test_same_idempotency_key_with_another_body_is_409(live_server: LiveServer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(3)])
    with BatchGenHttpClient(live_server.base_url) as client:
        file_id = client.upload_file(path)["id"]
        key = str(uuid.uuid4())
        client.create_batch(file_id, max_decoding_length=8, idempotency_key=key)
        with pytest.raises(APIStatusError) as info:
            client.create_batch(file_id, max_decoding_length=9, idempotency_key=key)
        assert info.value.status_code == 409
        assert len(batches_over(client, file_id)) == 1


def test_upload_and_create_retried_after_lost_responses_make_one_of_each(
    server_factory, tmp_path: Path
) -> None:
    server = server_factory("--simulated-latency-s", "0.5")  # the first batch is still running
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(3)])
    with FlakyProxy(server.base_url) as proxy:
        proxy.fail("POST", "/v1/files", DROP_AFTER_FORWARDING)
        proxy.fail("POST", "/v1/batches", DROP_AFTER_FORWARDING)
        with BatchGenHttpClient(proxy.base_url, retry=RetryPolicy(sleep=Waits(cap=0.0))) as client:
            file_id = client.upload_file(path)["id"]  # stored; the answer never arrived
            batch = client.create_batch(file_id)  # likewise
            assert [f["id"] for f in client.list_files(purpose="batch")["data"]] == [file_id]
            assert [b["id"] for b in batches_over(client, file_id)] == [batch["id"]]
    for route in ("/v1/files", "/v1/batches"):
        attempts = proxy.seen("POST", route)
        assert [a.answer for a in attempts] == ["dropped", "forwarded"]
        assert len({a.headers["Idempotency-Key"] for a in attempts}) == 1


# --- large files ---------------------------------------------------------------------------------


def test_large_output_is_streamed_to_disk(live_server: LiveServer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(20_000)])
    target = tmp_path / "output.jsonl"
    with BatchGenHttpClient(live_server.base_url) as client:
        tracemalloc.start()
        try:
            file_id = client.upload_file(path)["id"]
            upload_peak = tracemalloc.get_traced_memory()[1]
            batch = client.create_batch(file_id, max_decoding_length=16)
            batch = client.wait_for_batch(batch["id"], poll_interval=0.2)
            tracemalloc.reset_peak()
            client.download_file_to(batch["output_file_id"], target)
            download_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    size = target.stat().st_size
    assert batch["status"] == "completed"
    assert size > 5_000_000
    assert len(target.read_bytes().splitlines()) == 20_000
    assert download_peak < size / 10, (download_peak, size)
    assert upload_peak < path.stat().st_size / 4, (upload_peak, path.stat().st_size)


# --- following results -----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_follow_results_while_the_batch_runs(server_factory, tmp_path: Path) -> None:
    server = server_factory("--simulated-latency-s", "0.1", "--max-pool-size", "10")
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(80)])
    lines: list[str] = []
    statuses_at_first_line: list[str] = []
    async with AsyncBatchGenClient(server.base_url) as client:
        file_id = (await client.upload_file(path))["id"]
        batch = await client.create_batch(file_id)
        async for line in client.follow_results(batch["id"], poll_interval=0.1):
            if not lines:
                statuses_at_first_line.append((await client.get_batch(batch["id"]))["status"])
            lines.append(line)
        final = await client.get_batch(batch["id"])
    assert final["status"] == "completed"
    assert statuses_at_first_line == ["in_progress"]  # results arrived while it ran
    assert sorted(json.loads(line)["custom_id"] for line in lines) == sorted(
        f"request-{i}" for i in range(80)
    )
