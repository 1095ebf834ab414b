"""Test helpers: start a real ``batchgen-server`` process on 127.0.0.1, and build input files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx


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
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(storage_path: Path, *flags: str, timeout_s: float = 60.0) -> LiveServer:
    """Start ``batchgen-server`` with ``flags`` and wait until /health answers."""
    port = free_port()
    storage_path.mkdir(parents=True, exist_ok=True)
    log_path = storage_path.parent / f"server-{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the child process
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.server.cli",
            "--port",
            str(port),
            "--storage-path",
            str(storage_path),
            "--backend",
            "simulated",
            "--log-level",
            "warning",
            *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    server = LiveServer(process, f"http://127.0.0.1:{port}", storage_path, log_path)
    try:
        wait_until_ready(process, f"{server.base_url}/health", log_path, timeout_s)
    except RuntimeError:
        server.stop()
        raise
    return server


def wait_until_ready(process: subprocess.Popen[bytes], url: str, log_path: Path, timeout_s: float) -> None:
    """Wait until GET ``url`` answers 200; raise with the process's log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s:\n{log_path.read_text()}")


def chat_line(custom_id: str, content: str = "What is 2+2?", **body: object) -> dict[str, object]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "default", "messages": [{"role": "user", "content": content}], **body},
    }


def write_jsonl(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def wait_for_status(client: httpx.Client, batch_id: str, statuses: set[str], timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in statuses:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not reach {statuses}: {batch}")
