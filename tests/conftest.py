"""Shared fixtures: real ``batchgen-server`` processes on 127.0.0.1, each with its own storage; a
tiny model folder; the example echo backend package, installed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.live import LiveServer, start_server
from tests.tiny_model import build_tiny_model


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """Start servers with custom flags; each is stopped at the end of the test."""
    servers: list[LiveServer] = []

    def make(*flags: str, storage: str = "storage") -> LiveServer:
        server = start_server(tmp_path / storage, *flags)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One default server (simulated backend) shared by a test module."""
    server = start_server(tmp_path_factory.mktemp("live") / "storage")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight model folder (tests/tiny_model.py); needs the torch extra."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


#: The example third-party backend package that docs/backends-writing.md walks through.
ECHO_PACKAGE = Path(__file__).resolve().parents[1] / "examples" / "batchgen-backend-echo"


@pytest.fixture(scope="session")
def echo_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the example echo backend installed by pip, dist-info and all.

    Put it on ``sys.path`` (or ``PYTHONPATH``) and ``--backend echo`` is found through its entry
    point, as for any installed package. Built with this environment's hatchling, offline.
    """
    site = tmp_path_factory.mktemp("echo-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(ECHO_PACKAGE),
        ],
        check=True,
        timeout=300,
    )
    return site
