"""Live servers: start a real ``batchgen-server`` process on 127.0.0.1 and wait until it answers.

Tests that use these are marked ``live`` (see ``tests/conftest.py``). The request builders and
REST helpers live in ``tests.helpers``; the ones other modules import from here are re-exported.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import attrs
import httpx

from tests.helpers import chat_line, wait_for_status, write_jsonl

__all__ = [
    "LiveServer",
    "chat_line",
    "free_port",
    "launch_server",
    "start_server",
    "stop_servers",
    "wait_for_status",
    "wait_until_ready",
    "write_jsonl",
]


@attrs.define
class LiveServer:
    """A running server process: its base URL, storage folder and log."""

    process: subprocess.Popen[bytes]
    base_url: str
    storage_path: Path
    log_path: Path

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self) -> None:
        """SIGTERM, then wait for the exit (SIGKILL after 15 s)."""
        stop_servers([self])

    def wait_ready(self, timeout_s: float = 60.0, ready: tuple[int, ...] = (200,)) -> None:
        """Wait until /health answers one of ``ready``; on failure stop the process and raise."""
        try:
            wait_until_ready(self.process, f"{self.base_url}/health", self.log_path, timeout_s, ready)
        except RuntimeError:
            self.stop()
            raise


def stop_servers(servers: Iterable[LiveServer]) -> None:
    """SIGTERM every one of ``servers`` first, then wait for each: a fleet's shutdowns overlap."""
    running = [server.process for server in servers if server.process.poll() is None]
    for process in running:
        process.terminate()
    for process in running:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


#: Ports handed out by ``free_port``: below Linux's ephemeral range (32768 up), so no connection's
#: own port can take one, and split into one block per pytest-xdist worker, so two workers never
#: hand out the same port between one's check and its server's bind.
_PORT_FIRST, _PORT_BLOCK, _PORT_BLOCKS = 20000, 1000, 12
_next_ports: Iterator[int] | None = None


def _worker_ports() -> Iterator[int]:
    """This worker's block, from a random place in it: two pytest runs on one machine (the same
    worker number in each) seldom walk the same ports at the same time."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = _PORT_FIRST + (int(worker) % _PORT_BLOCKS if worker.isdigit() else 0) * _PORT_BLOCK
    start = random.randrange(_PORT_BLOCK)
    block = range(first, first + _PORT_BLOCK)
    return itertools.cycle([*block[start:], *block[:start]])


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now, from this worker's own block."""
    global _next_ports
    if _next_ports is None:
        _next_ports = _worker_ports()
    for port in itertools.islice(_next_ports, _PORT_BLOCK):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block of {_PORT_BLOCK}")


#: Set to a ``--dtype`` choice (``float32``) to run every transformers server the tests start in
#: it: on a CPU with native bfloat16, ``BATCHGEN_TEST_DTYPE=float32`` runs the model tests as a
#: CPU without it does (AVX2 only), so that no test passes on one instruction set alone.
TEST_DTYPE_VARIABLE = "BATCHGEN_TEST_DTYPE"


def dtype_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``--dtype`` from ``BATCHGEN_TEST_DTYPE`` for a transformers server that sets none."""
    dtype = os.environ.get(TEST_DTYPE_VARIABLE)
    transformers = ("--backend", "transformers") in itertools.pairwise(flags)
    if not dtype or not transformers or "--dtype" in flags:
        return ()
    return ("--dtype", dtype)


def start_server(
    storage_path: Path,
    *flags: str,
    timeout_s: float = 60.0,
    ready: tuple[int, ...] = (200,),
    environ: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> LiveServer:
    """Start ``batchgen-server`` with ``flags`` (and ``environ`` added to this process's
    environment) and wait until /health answers. ``host`` is the address it serves on (another
    than loopback, ``--allow-unauthenticated`` too); ``wrap`` makes the command line run
    elsewhere (``Namespace.command``: inside a network namespace)."""
    server = launch_server(storage_path, *flags, environ=environ, host=host, wrap=wrap)
    server.wait_ready(timeout_s, ready)
    return server


def launch_server(
    storage_path: Path,
    *flags: str,
    environ: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> LiveServer:
    """``start_server`` without the wait: the process is started, and ``wait_ready`` waits for it
    (several launched first and then waited for start together)."""
    port = free_port()
    storage_path.mkdir(parents=True, exist_ok=True)
    log_path = storage_path.parent / f"server-{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the child process
    served_on = () if host == "127.0.0.1" else ("--host", host, "--allow-unauthenticated")
    command = [
        sys.executable,
        "-m",
        "batchgen.server.cli",
        "--port",
        str(port),
        *served_on,
        "--storage-path",
        str(storage_path),
        "--backend",
        "simulated",
        "--log-level",
        "warning",
        *flags,
        *dtype_flags(flags),
    ]
    process = subprocess.Popen(
        command if wrap is None else wrap(command),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(environ or {}), "PYTHONUNBUFFERED": "1"},
    )
    return LiveServer(process, f"http://{host}:{port}", storage_path, log_path)


def wait_until_ready(
    process: subprocess.Popen[bytes],
    url: str,
    log_path: Path,
    timeout_s: float,
    ready: tuple[int, ...] = (200,),
) -> None:
    """Wait until GET ``url`` answers one of ``ready`` (200: healthy); raise with the process's log
    if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(url, timeout=2).status_code in ready:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s:\n{log_path.read_text()}")
