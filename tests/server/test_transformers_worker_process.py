"""A ``batchgen-server`` with the transformers backend: its model worker process, seen from outside.

The server (a real process on 127.0.0.1, with the tiny random-weight model) runs the model in a
child process. Killing that child mid-batch loses no request and writes none twice; stopping the
server, or killing it, leaves no worker behind; and the API runs at a lower priority than the
model's worker.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from batchgen.server.priority import API_SLICE_NS
from tests.helpers import chat_line, file_lines, submit, wait_for_status
from tests.live import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.live]

WORKER_MODULE = "batchgen.core.backends.hf_worker"


def _workers_of(pid: int) -> list[int]:
    """The transformers worker processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent == pid and WORKER_MODULE in command:
            found.append(int(entry.name))
    return found


def _stat_fields(pid: int, thread: int | None = None) -> list[str]:
    """/proc stat fields of a process (its main thread) or of one of its threads, from field 3."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    return Path(path).read_text().rpartition(")")[2].split()


def _nice(pid: int, thread: int | None = None) -> int:
    return int(_stat_fields(pid, thread)[16])


def _policy(pid: int, thread: int | None = None) -> int:
    return int(_stat_fields(pid, thread)[38])


def _slice_ns(pid: int) -> int:
    """The scheduler slice of the process's main thread (``se.slice`` in /proc/PID/sched)."""
    for line in Path(f"/proc/{pid}/sched").read_text().splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    raise AssertionError("no se.slice in /proc/PID/sched")


def _custom_slices() -> bool:
    """Whether this kernel honours a thread's own slice (Linux 6.12 and later)."""
    major, minor = (int(part) for part in re.findall(r"\d+", platform.release())[:2])
    return (major, minor) >= (6, 12)


def _threads(pid: int) -> list[int]:
    return [int(entry.name) for entry in Path(f"/proc/{pid}/task").iterdir()]


def _gone(pid: int, within_s: float = 60.0) -> bool:
    """Whether process ``pid`` has ended (is gone, or a zombie nobody waits for) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _tiny_server(server_factory: Callable[..., LiveServer], tiny_model: Path, *flags: str) -> LiveServer:
    return server_factory(
        "--backend", "transformers", "--model", str(tiny_model), "--max-batch-size", "4", *flags
    )


def test_a_killed_worker_is_replaced_and_each_request_has_one_line(
    server_factory: Callable[..., LiveServer], tiny_model: Path
) -> None:
    # At SCHED_IDLE (the default with a CPU model) a poll can wait for the model's next pause, and
    # the tiny model may finish the batch meanwhile; nice +10 lets the kill land mid-batch.
    server = _tiny_server(server_factory, tiny_model, "--api-nice", "10")
    [worker] = _workers_of(server.process.pid)
    lines = [chat_line(f"q{n}", f"Question {n}", max_tokens=120) for n in range(12)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch = submit(client, lines)
        deadline = time.monotonic() + 120
        while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 0:
            assert time.monotonic() < deadline, "no request finished"
            time.sleep(0.02)
        os.kill(worker, signal.SIGKILL)  # mid-batch: some requests done, some running, some queued
        done = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=300)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        output = file_lines(client, done["output_file_id"])
        assert client.get("/health").status_code == 200
    assert Counter(line["custom_id"] for line in output) == Counter(f"q{n}" for n in range(12))
    assert all(line["error"] is None for line in output)
    assert {line["response"]["body"]["usage"]["completion_tokens"] for line in output} == {120}
    assert _gone(worker)
    [replacement] = _workers_of(server.process.pid)
    assert replacement != worker


def test_the_api_yields_the_cpu_to_the_worker_and_leaves_no_worker_behind(
    server_factory: Callable[..., LiveServer], tiny_model: Path
) -> None:
    server = _tiny_server(server_factory, tiny_model)
    [worker] = _workers_of(server.process.pid)
    # The model computes on the CPU, so the event loop's thread (the process's main thread) runs at
    # SCHED_IDLE; the model's threads keep our priority.
    assert _policy(server.process.pid) == os.SCHED_IDLE
    ours = (os.sched_getscheduler(0), _nice(os.getpid()))
    assert [(_policy(worker, t), _nice(worker, t)) for t in _threads(worker)] == [ours] * len(
        _threads(worker)
    )
    # Nor does the thread that reads the worker's results and heartbeats (made before the change).
    assert any(_policy(server.process.pid, t) == ours[0] for t in _threads(server.process.pid))
    server.stop()
    assert _gone(worker, within_s=0), "the server waits for its worker before it exits"


def test_a_worker_outlives_no_killed_server(
    server_factory: Callable[..., LiveServer], tiny_model: Path
) -> None:
    server = _tiny_server(server_factory, tiny_model)
    [worker] = _workers_of(server.process.pid)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        submit(client, [chat_line(f"q{n}", max_tokens=2000) for n in range(8)])
    server.process.kill()
    server.process.wait()
    assert _gone(worker), "the worker notices its pipe closed and exits"


@pytest.mark.parametrize(
    "backend", [("--backend", "simulated"), ("--backend", "embeddings"), ("--api-nice", "10")]
)
def test_a_nice_increment_with_a_short_slice(
    server_factory: Callable[..., LiveServer], tiny_model: Path, backend: tuple[str, str]
) -> None:
    """With no model on the CPU in a worker process (auto: the embeddings model runs on a thread
    the event loop feeds), or asked for, the API takes nice +10 and a short slice."""
    model = ("--backend", "transformers", "--model", str(tiny_model))
    server = server_factory(*(backend if backend[0] == "--backend" else (*model, *backend)))
    assert (_policy(server.process.pid), _nice(server.process.pid)) == (
        os.SCHED_OTHER,
        _nice(os.getpid()) + 10,
    )
    if _custom_slices():
        assert _slice_ns(server.process.pid) == API_SLICE_NS
    for worker in _workers_of(server.process.pid):
        assert (_policy(worker), _nice(worker)) == (os.sched_getscheduler(0), _nice(os.getpid()))


def test_api_nice_zero_keeps_the_priority(
    server_factory: Callable[..., LiveServer], tiny_model: Path
) -> None:
    server = server_factory("--backend", "transformers", "--model", str(tiny_model), "--api-nice", "0")
    assert (_policy(server.process.pid), _nice(server.process.pid)) == (
        os.sched_getscheduler(0),
        _nice(os.getpid()),
    )
