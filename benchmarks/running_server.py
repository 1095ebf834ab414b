"""A ``batchgen-server`` subprocess for the benchmarks: start it, run one batch through it, stop it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

TERMINAL = ("completed", "failed", "cancelled", "expired")


@contextmanager
def running_server(
    storage: Path, port: int, *flags: str, python: str = sys.executable
) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    """The server process (run by ``python``) and a client for it, once ``/health`` answers 200."""
    command = [
        python,
        "-m",
        "batchgen.server.cli",
        "--port",
        str(port),
        "--storage-path",
        str(storage),
    ]
    server = subprocess.Popen([*command, "--log-level", "warning", *flags])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None:
                    raise RuntimeError("batchgen-server exited before it became healthy")
                time.sleep(0.1)
            yield server, client
    finally:
        server.terminate()
        server.wait()


def upload(client: httpx.Client, content: Path | bytes) -> tuple[str, float]:
    """Upload a batch input file; its file id and the seconds the upload took (with validation)."""
    started = time.perf_counter()
    part = content.open("rb") if isinstance(content, Path) else ("input.jsonl", content)
    try:
        response = client.post("/v1/files", files={"file": part}, data={"purpose": "batch"})
    finally:
        if isinstance(content, Path):
            part.close()  # type: ignore[union-attr]
    response.raise_for_status()
    return response.json()["id"], time.perf_counter() - started


def run_batch(client: httpx.Client, content: Path | bytes) -> tuple[dict[str, Any], float, float]:
    """Upload a chat batch file, run it to the end; the batch, upload seconds and run seconds."""
    file_id, upload_s = upload(client, content)
    uploaded = time.perf_counter()
    batch = client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    ).json()
    while batch["status"] not in TERMINAL:
        # as a client would: not 20 times a second through a long batch (each poll is server CPU
        # taken from the engine on a small machine), yet often enough that the time it adds to the
        # figure stays under half a percent of it
        time.sleep(min(1.0, max(0.05, (time.perf_counter() - uploaded) / 200)))
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return batch, upload_s, time.perf_counter() - uploaded


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
