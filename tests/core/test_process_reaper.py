"""``ProcessReaper`` kills the processes it watches once the process holding its pipe dies, and never
a process that merely took a watched pid's number (checked by start time).

Real processes throughout: a "server" child that starts a "sleeper" grandchild and a reaper for it,
then is killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen.core.backends import process_reaper
from batchgen.core.backends.process_reaper import ProcessReaper, descendants, reaped_start, start_time

pytestmark = pytest.mark.live

#: A stand-in server: starts a sleeper and a reaper for it, prints both pids, then waits.
SERVER = """
import subprocess, sys, time
from batchgen.core.backends.process_reaper import ProcessReaper
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
reaper = ProcessReaper([sleeper.pid])
print(sleeper.pid, reaper.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    state = None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_killed_server_takes_its_watched_processes_with_it() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        sleeper, reaper = map(int, server.stdout.readline().split())
        assert _alive(sleeper) and _alive(reaper)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        assert _wait_gone(sleeper), "the watched process outlived its server"
        assert _wait_gone(reaper)
    finally:
        server.kill()


def test_closing_the_reaper_kills_what_is_left_and_nothing_else() -> None:
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(timeout=10)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        reaper = ProcessReaper([left.pid, ended.pid])
        assert [target.split(":")[0] for target in reaper.targets] == [str(left.pid)]  # ended: no start time
        reaper.close()
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert _alive(bystander.pid)
    finally:
        for process in (left, bystander):
            process.kill()
            process.wait()


def test_a_pid_taken_by_another_process_is_spared(monkeypatch: pytest.MonkeyPatch) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = start_time(bystander.pid)
        assert started is not None
        # the reaper was told of a process with this pid that started at another time
        monkeypatch.setattr(process_reaper, "start_time", lambda pid: str(int(started) + 1))
        reaper = ProcessReaper([bystander.pid])
        reaper.close()
        assert _alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()


def test_descendants_finds_grandchildren_by_command() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        found: list[int] = []
        while time.monotonic() < deadline and len(found) < 2:
            found = descendants(os.getpid(), sys.executable)
            time.sleep(0.05)
        assert parent.pid in found and len(found) >= 2
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_a_reaped_start_owns_only_the_processes_it_started() -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    # a process of the same name that was there before (another engine, a vllm serve a test runs)
    before = subprocess.Popen(sleep)
    started: list[subprocess.Popen[bytes]] = []

    def start() -> str:
        started.append(subprocess.Popen(sleep))
        return "engine"

    try:
        result, reaper = reaped_start(start, sys.executable)
        assert result == "engine"
        assert [target.split(":")[0] for target in reaper.targets] == [str(started[0].pid)]
        reaper.close()
        assert started[0].wait(timeout=10) == -signal.SIGKILL
        assert _alive(before.pid), "a process the start did not make was killed"
    finally:
        for process in (before, *started):
            process.kill()
