"""Nothing finished is lost: kills and restarts, fast cancellation, expiry, idempotency, full disks.

Kills, restarts and the full disk (a tmpfs mounted with ``mount``) run real ``batchgen-server``
processes on 127.0.0.1; the rest run the real app in this process (Litestar's test client).
Both use real SQLite and real files.
"""

from __future__ import annotations

import errno
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import (
    TERMINAL,
    ApiFactory,
    chat_line,
    create_batch,
    jsonl,
    post_file,
    read_jsonl,
    upload,
    wait_for_status,
    write_jsonl,
)
from tests.live import LiveServer


def _persisted_completed(storage: Path, batch_id: str) -> int:
    with sqlite3.connect(storage / "metadata.sqlite3") as db:
        return int(db.execute("SELECT completed FROM batches WHERE id = ?", [batch_id]).fetchone()[0])


def _complete_prefix(path: Path) -> bytes:
    data = path.read_bytes() if path.exists() else b""
    return data[: data.rfind(b"\n") + 1]


@pytest.mark.parametrize("stop_signal", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_stopped_at_random_points_every_request_ends_exactly_once(
    server_factory: Callable[..., LiveServer], tmp_path: Path, stop_signal: signal.Signals
) -> None:
    flags = ("--simulated-latency-s", "0.05", "--max-pool-size", "32", "--fsync-interval-ms", "50")
    total = 3000
    input_path = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", f"prompt {i}") for i in range(total)])
    rng = random.Random(1234)
    server = server_factory(*flags, storage="durable")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch_id = create_batch(client, upload(client, input_path)["id"])["id"]
    output = server.storage_path / "incremental" / f"{batch_id}.jsonl"

    kept: bytes = b""
    for _ in range(3):
        # a stop at a random point while the batch runs: after this server wrote a line (the
        # output file is made on the first), however slowly a loaded machine brings it there
        deadline = time.monotonic() + 60
        while len(_complete_prefix(output)) <= len(kept):
            assert time.monotonic() < deadline, "the restarted server wrote no line"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))
        server.process.send_signal(stop_signal)
        server.process.wait(timeout=30)
        written = _complete_prefix(output)
        if stop_signal == signal.SIGTERM:
            assert server.process.returncode == 0, server.log_path.read_text()  # a stop asked for
            assert output.read_bytes() == written, "a graceful stop leaves no torn line"
            assert _persisted_completed(server.storage_path, batch_id) == len(written.splitlines()), (
                "a graceful stop persists the counters"
            )
        assert written.startswith(kept), "a line written before a stop changed"
        kept = written
        assert len(kept.splitlines()) < total, "the batch finished before the stop; the test proves nothing"
        server = server_factory(*flags, storage="durable")

    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch = wait_for_status(client, batch_id, TERMINAL, timeout_s=120)
    assert batch["status"] == "completed"
    assert output.read_bytes().startswith(kept)
    ids = [line["custom_id"] for line in read_jsonl(output)]
    assert len(ids) == len(set(ids)) == total, "every request ends with exactly one line"
    assert set(ids) == {f"r{i}" for i in range(total)}
    assert batch["request_counts"] == {"total": total, "completed": total, "failed": 0}
    assert batch["usage"]["output_tokens"] == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in read_jsonl(output)
    )


def test_cancel_aborts_in_flight_requests_within_seconds(api_factory: ApiFactory) -> None:
    client = api_factory("--simulated-latency-s", "60", "--max-pool-size", "8")
    batch = create_batch(client, upload(client, jsonl(*[chat_line(f"r{i}") for i in range(50)]))["id"])
    wait_for_status(client, batch["id"], {"in_progress"})
    deadline = time.monotonic() + 10
    while client.get("/v1/pool/status").json()["scheduling_pool_active"] < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    client.post(f"/v1/batches/{batch['id']}/cancel").raise_for_status()
    cancelled = wait_for_status(client, batch["id"], {"cancelled"}, timeout_s=10)
    assert time.monotonic() - started < 3, "in-flight requests were not aborted"
    assert cancelled["request_counts"] == {"total": 50, "completed": 0, "failed": 0}
    pool = client.get("/v1/pool/status").json()
    assert pool["scheduling_pool_active"] == 0 and pool["intake_pool_size"] == 0


@pytest.mark.parametrize(("flags", "status"), [((), "failed"), (("--error-file", "openai"), "expired")])
def test_batch_past_its_window_ends_with_partial_results(
    api_factory: ApiFactory, flags: tuple[str, ...], status: str
) -> None:
    """The guide: ``failed`` with ``batch_failed`` saying it timed out; OpenAI's switch: ``expired``."""
    client = api_factory("--simulated-latency-s", "0.3", "--max-pool-size", "1", *flags)
    file_id = upload(client, jsonl(*[chat_line(f"r{i}") for i in range(40)]))["id"]
    batch = create_batch(client, file_id, completion_window="2s")
    ended = wait_for_status(client, batch["id"], {"expired", "failed", "completed"}, timeout_s=20)
    assert ended["status"] == status
    stamp = "expired_at" if status == "expired" else "failed_at"
    assert ended[stamp] is not None and ended[stamp] >= ended["expires_at"]
    done = ended["request_counts"]["completed"]
    assert 1 <= done < 40
    if status == "failed":
        assert ended["error"]["code"] == "batch_failed"
        message = ended["error"]["message"]
        assert "timed out" in message and "2s" in message and f"{done} of 40 requests finished" in message
        assert ended["errors"]["data"][0]["code"] == "batch_failed"
    else:
        assert ended["error"] is None and ended["errors"] is None
    content = client.get(f"/v1/files/{ended['output_file_id']}/content").content
    assert len(content.splitlines()) == done
    time.sleep(0.5)
    again = client.get(f"/v1/batches/{batch['id']}").json()
    assert (again["status"], again["request_counts"]["completed"]) == (status, done)


def test_idempotency_key_returns_the_same_objects(api_factory: ApiFactory) -> None:
    client = api_factory()
    content = jsonl(chat_line("a"), chat_line("b"))
    first_file = upload(client, content, headers={"Idempotency-Key": "file-key-1"})
    assert upload(client, content, headers={"Idempotency-Key": "file-key-1"})["id"] == first_file["id"]
    clash = post_file(client, jsonl(chat_line("c")), headers={"Idempotency-Key": "file-key-1"})
    assert clash.status_code == 409 and "Idempotency-Key" in clash.json()["error"]["message"]

    body = {"input_file_id": first_file["id"], "endpoint": "/v1/chat/completions"}
    headers = {"Idempotency-Key": "batch-key-1"}
    first = client.post("/v1/batches", json=body, headers=headers).json()
    again = client.post("/v1/batches", json=body, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first["id"]
    changed = client.post("/v1/batches", json={**body, "metadata": {"x": "y"}}, headers=headers)
    assert changed.status_code == 409
    batches = [
        b["id"] for b in client.get("/v1/batches").json()["data"] if b["input_file_id"] == first_file["id"]
    ]
    assert batches == [first["id"]]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted where the server writes result files (its database stays on another disk)."""
    incremental = tmp_path / "disk" / "incremental"
    incremental.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(incremental)], check=True)
    try:
        yield tmp_path / "disk"
    finally:
        subprocess.run(["umount", "-l", str(incremental)], check=False)


def _fill(folder: Path) -> Path:
    """Write a filler file until the filesystem is full; return it (delete it to free the space)."""
    filler = folder / "filler.bin"
    with open(filler, "wb", buffering=0) as stream:
        try:
            while True:
                stream.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _gauge(client: httpx.Client, name: str) -> float:
    """A gauge's value in ``GET /metrics``."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def test_a_full_disk_pauses_the_batch_and_it_completes_once_space_returns(
    server_factory: Callable[..., LiveServer], small_disk: Path
) -> None:
    """The result folder fills up mid-batch: nothing fails and no line is lost or doubled. Work
    pauses (health 503 naming the full disk, the pause in /metrics, the batch in_progress with its
    progress stalled), and it resumes by itself once the space is freed."""
    flags = ("--simulated-latency-s", "0.05", "--max-pool-size", "8", "--fsync-interval-ms", "50")
    server = server_factory(*flags, storage="disk")
    assert server.storage_path.resolve() == small_disk.resolve()
    total = 1500
    custom_ids = [f"r{i}" for i in range(total)]
    output = small_disk / "incremental"
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        input_file = upload(client, jsonl(*[chat_line(custom_id) for custom_id in custom_ids]))
        batch_id = create_batch(client, input_file["id"])["id"]

        def batch() -> dict[str, Any]:
            seen: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").json()
            assert seen["status"] == "in_progress", seen  # never failed (nor done) while the disk is full
            return seen

        wait_for_status(client, batch_id, {"in_progress"})
        _wait(lambda: batch()["request_counts"]["completed"] > 0, "the batch has written lines")
        filler = _fill(output)

        def paused() -> bool:
            batch()
            health = client.get("/health")
            return health.status_code == 503 and "No space left on device" in health.text

        _wait(paused, "/health answers 503 naming the full disk")
        assert _gauge(client, "batchgen_storage_paused") == 1
        _wait(lambda: _gauge(client, "batchgen_slots_active") == 0, "the requests running have ended")
        assert _gauge(client, "batchgen_held_result_lines") > 0
        assert _gauge(client, "batchgen_intake_queued_requests") > 0  # nothing new is admitted
        stalled = batch()["request_counts"]
        assert stalled["failed"] == 0 and stalled["completed"] < total
        for _ in range(20):  # it stays paused: the batch does not move, the health does not clear
            assert batch()["request_counts"] == stalled
            assert paused() and _gauge(client, "batchgen_storage_paused") == 1
            time.sleep(0.05)

        filler.unlink()
        done = wait_for_status(client, batch_id, TERMINAL, timeout_s=180)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": total, "completed": total, "failed": 0}
        lines = [
            line
            for path in sorted(output.iterdir())
            if path.name.startswith(batch_id)
            for line in read_jsonl(path)
        ]
        assert sorted(line["custom_id"] for line in lines) == sorted(custom_ids)  # each exactly once
        assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in lines)
        _wait(lambda: client.get("/health").status_code == 200, "/health is healthy again")
        assert _gauge(client, "batchgen_storage_paused") == 0
        assert _gauge(client, "batchgen_held_result_lines") == 0


def test_files_expire_and_free_their_disk(api_factory: ApiFactory, tmp_path: Path) -> None:
    client = api_factory("--file-expiry-s", "2")
    content = jsonl(chat_line("a"))
    short = client.post(
        "/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "1"},
    ).json()
    assert short["expires_at"] == short["created_at"] + 1
    default = upload(client, content)
    assert default["expires_at"] == default["created_at"] + 2
    batch = wait_for_status(client, create_batch(client, default["id"])["id"], TERMINAL)
    output = client.get(f"/v1/files/{batch['output_file_id']}").json()
    assert output["expires_at"] is not None
    time.sleep(3.5)
    for file_id in (short["id"], default["id"], batch["output_file_id"]):
        assert client.get(f"/v1/files/{file_id}").status_code == 404
    storage = tmp_path / "storage"
    assert list((storage / "files").iterdir()) == []
    assert not (storage / "incremental" / f"{batch['id']}.jsonl").exists()
    assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed"
