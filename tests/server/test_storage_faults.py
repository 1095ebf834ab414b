"""Storage faults on a real full filesystem, and a core that stops, against real server processes.

The whole storage folder (SQLite database, uploads, result files) lives on a small tmpfs mounted
with ``mount`` (the machines the suite runs on allow it as root; elsewhere the test skips, saying
why). Filling it must pause the batch being written (health 503, nothing failed, no line lost),
answer calls with 507 (never 500) and leave nothing half made; freeing it must bring everything
back by itself, the batch completing with every line once; and a ``kill -9`` and a restart must
not change any status a client saw. Injected faults at the storage protocols are in
``tests/core/test_storage_faults.py``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import (
    TERMINAL,
    chat_line,
    create_batch,
    jsonl,
    post_batch,
    post_file,
    upload,
    wait_for_status,
)
from tests.live import LiveServer, free_port, wait_until_ready

FLAGS = ("--simulated-latency-s", "0.01", "--max-pool-size", "8", "--fsync-interval-ms", "50")
#: Slow enough that the batch is still running when the disk fills (600 lines: at least 3.75 s).
SLOW_FLAGS = ("--simulated-latency-s", "0.05", "--max-pool-size", "8", "--fsync-interval-ms", "50")


@pytest.fixture
def small_storage(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs holding the whole storage folder."""
    storage = tmp_path / "small"
    storage.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(storage)], check=False)
    if mounted.returncode != 0:
        pytest.skip("mounting a tmpfs is not allowed here (needs root); the full-disk tests need one")
    try:
        yield storage
    finally:
        subprocess.run(["umount", "-l", str(storage)], check=False)


def _fill(folder: Path) -> Path:
    """Write a filler file until the filesystem is full; return it (delete it to free the space)."""
    filler = folder / "filler.bin"
    with open(filler, "wb", buffering=0) as stream:
        block = b"\0" * 4096
        try:
            while True:
                stream.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _statuses(client: httpx.Client) -> dict[str, str]:
    return {
        batch["id"]: batch["status"]
        for batch in client.get("/v1/batches", params={"limit": 100}).json()["data"]
    }


def _gauge(client: httpx.Client, name: str) -> float:
    """A gauge's value in ``GET /metrics``."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_full_disk_pauses_the_batch_refuses_calls_and_everything_recovers(
    server_factory: Callable[..., LiveServer], small_storage: Path
) -> None:
    server = server_factory(*SLOW_FLAGS, storage="small")
    assert server.storage_path.resolve() == small_storage.resolve()
    total = 600
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        done = create_batch(client, upload(client, jsonl(*[chat_line(f"d{i}") for i in range(5)]))["id"])
        assert wait_for_status(client, done["id"], TERMINAL)["status"] == "completed"
        spare = upload(client, jsonl(*[chat_line(f"s{i}") for i in range(3)]))
        big = create_batch(client, upload(client, jsonl(*[chat_line(f"r{i}") for i in range(total)]))["id"])
        wait_for_status(client, big["id"], {"in_progress"})
        files_before = {file["id"] for file in client.get("/v1/files").json()["data"]}
        blobs_before = sorted((small_storage / "files").iterdir())

        filler = _fill(small_storage)
        deadline = time.monotonic() + 60  # a line of the running batch meets the full disk, whatever the load
        while client.get("/health").status_code != 503 or _gauge(client, "batchgen_storage_paused") != 1:
            assert time.monotonic() < deadline, (
                "work did not pause on the full disk: " + client.get("/health").text
            )
            assert client.get(f"/v1/batches/{big['id']}").json()["status"] == "in_progress"
            time.sleep(0.05)
        assert "No space left on device" in client.get("/health").text
        refused = post_file(client, jsonl(chat_line("x")))
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert error["code"] == "insufficient_storage" and "No space left on device" in error["message"]
        created = post_batch(client, spare["id"])
        assert created.status_code in (200, 503, 507), created.text  # never a 500
        if created.status_code != 200:
            assert spare["id"] not in {b["input_file_id"] for b in client.get("/v1/batches").json()["data"]}
        assert {file["id"] for file in client.get("/v1/files").json()["data"]} == files_before
        assert sorted((small_storage / "files").iterdir()) == blobs_before, "a refused upload left a blob"
        assert list((small_storage / "staging").iterdir()) == []
        assert client.get(f"/v1/batches/{big['id']}").json()["status"] == "in_progress"

        filler.unlink()
        finished = wait_for_status(client, big["id"], TERMINAL, timeout_s=120)
        assert finished["status"] == "completed", finished
        assert finished["request_counts"] == {"total": total, "completed": total, "failed": 0}
        output = small_storage / "incremental" / f"{big['id']}.jsonl"
        ids = [json.loads(line)["custom_id"] for line in output.read_bytes().splitlines()]
        assert sorted(ids) == sorted(f"r{i}" for i in range(total)), "a line was lost or written twice"
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health").text
            time.sleep(0.1)
        assert _gauge(client, "batchgen_storage_paused") == 0
        after = create_batch(client, upload(client, jsonl(chat_line("a"), chat_line("b")))["id"])
        assert wait_for_status(client, after["id"], TERMINAL)["status"] == "completed"
        if created.status_code == 200:
            assert (
                wait_for_status(client, created.json()["id"], TERMINAL, timeout_s=30)["status"] == "completed"
            )
        seen = _statuses(client)
    assert set(seen.values()) == {"completed"}

    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=30)
    again = server_factory(*SLOW_FLAGS, storage="small")
    with httpx.Client(base_url=again.base_url, timeout=30) as client:
        time.sleep(1)  # recovery would have resumed a batch it wrongly thought unfinished by now
        assert _statuses(client) == seen, "a status a client saw changed after the restart"


#: A ``batchgen-server`` whose scheduler loop raises once work is queued: a fault put into the
#: test's own process (no production code carries a test hook) to see the real exit path.
_BROKEN_SCHEDULER = """
import sys
from batchgen.core.scheduling.scheduler import Scheduler
from batchgen.server.cli import main

admit = Scheduler.admit
def broken(self, *args, **kwargs):
    if self.intake_pool.size:
        raise RuntimeError("injected scheduler fault")
    return admit(self, *args, **kwargs)
Scheduler.admit = broken
main(sys.argv[1:])
"""


@pytest.mark.live
def test_a_server_whose_core_stopped_exits_non_zero(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BROKEN_SCHEDULER,
                "--port",
                str(port),
                "--backend",
                "simulated",
                "--storage-path",
                str(tmp_path / "storage"),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/health", log_path, 60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            create_batch(client, upload(client, jsonl(chat_line("a")))["id"])
        assert process.wait(timeout=30) == 1, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log_path.read_text()
    assert "injected scheduler fault" in output and "the batch service stopped" in output
