"""ProcessReaper: ends an engine's processes when the server process dies without stopping them.

vLLM's engine core runs in a process the engine library starts itself, and it does not notice its
parent dying: after a ``kill -9`` of the server it would keep its memory (the model, the KV cache)
and its cores forever. The reaper is a tiny watcher process started beside the engine. It is
given the engine's processes (each by pid and start time, so a pid the system later reuses is
never touched) and blocks reading a pipe from the server; the pipe closes when the server ends
in any way, the kernel closing it for a killed process, and the watcher then kills those of the
processes still alive. A backend that stops its engine normally closes the pipe after the
engine's own shutdown, and the watcher finds nothing left to kill.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

#: The watcher: read stdin to its end, then SIGKILL each ``pid:starttime`` argument still alive.
_WATCHER = """
import os, signal, sys
sys.stdin.buffer.read()
for target in sys.argv[1:]:
    pid, started = target.split(":")
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        if fields[19] == started:
            os.kill(int(pid), signal.SIGKILL)
    except (OSError, IndexError, ValueError):
        pass
"""


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of ``/proc/PID/stat``), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int, command_prefix: str = "") -> list[int]:
    """The live descendants of ``pid`` whose command line starts with ``command_prefix``."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except (OSError, IndexError, ValueError):
            continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return sorted(child for child in found if commands.get(child, "").startswith(command_prefix))


class ProcessReaper:
    """A watcher that kills ``pids`` if this process dies before ``close`` (Linux ``/proc``)."""

    def __init__(self, pids: Iterable[int]) -> None:
        targets = [f"{pid}:{started}" for pid in pids if (started := start_time(pid)) is not None]
        self.targets = tuple(targets)
        self._watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, *targets],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C of the server's terminal does not end it first
        )

    def close(self) -> None:
        """Let the watcher go: it kills what is left of the processes (normally nothing) and exits."""
        if self._watcher.stdin is not None and not self._watcher.stdin.closed:
            self._watcher.stdin.close()
        try:
            self._watcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._watcher.kill()
            self._watcher.wait()

    @property
    def pid(self) -> int:
        return self._watcher.pid


#: One start at a time in this process, so that the processes that appear during a start are its own.
_STARTS = threading.Lock()


def reaped_start(start: Callable[[], T], command_prefix: str) -> tuple[T, ProcessReaper]:
    """Call ``start`` and return its result with a reaper for the processes it started: this
    process's descendants whose command line starts with ``command_prefix`` that were not there
    before (each by pid and start time). Processes of that name started otherwise (another engine
    in this process, a server a test runs) are not the reaper's, and survive its ``close``. Starts
    through here are one at a time, so two starting together cannot take each other's processes."""
    with _STARTS:
        before = {(pid, start_time(pid)) for pid in descendants(os.getpid(), command_prefix)}
        result = start()
        started = [
            pid for pid in descendants(os.getpid(), command_prefix) if (pid, start_time(pid)) not in before
        ]
        return result, ProcessReaper(started)
