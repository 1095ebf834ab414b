"""Real replicas refuse a database and a blob folder of different clusters, and stop working when
their folder stops being their cluster's.

A replica started with the cluster's database and another folder (the case that lost output: it
committed results where no other replica could read them) exits at once with one paragraph naming
both; so does a replica with a database of its own pointed at the cluster's folder (the case that
deleted the cluster's output). A running replica whose folder loses its cluster mark answers
``/health`` 503 with the reason and claims nothing, and is healthy again once the mark is back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from batchgen.core.work.segment_store import CLUSTER_MARK_KEY
from tests.helpers import chat_line, submit, wait_for_status
from tests.live import free_port
from tests.postgres import PostgresServer
from tests.replica_fleet import Blobs, start_replica

pytestmark = pytest.mark.live

DEADLINE_S = 120.0


def _refused(storage: Path, database: str, folder: Path) -> str:
    """Start a replica that must refuse; its output (exit code non-zero, no traceback)."""
    command = [sys.executable, "-m", "batchgen.server.cli", "--storage-path", str(storage),
               "--port", str(free_port()), "--backend", "simulated", "--metadata-url", database,
               "--blob-url", folder.as_uri(), "--replica-id", "stray"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, env=dict(os.environ))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    [paragraph] = [line for line in output.splitlines() if line.startswith("batchgen-server: error: ")]
    assert "backend" not in paragraph  # the reason is the storage, not an engine
    return paragraph


def _health(base_url: str) -> httpx.Response:
    return httpx.get(f"{base_url}/health", timeout=30)


def _wait_for_health(base_url: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        response = _health(base_url)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def test_a_replica_on_another_clusters_folder_or_database_refuses_and_a_swapped_folder_stops_it(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    database, folder = postgres_server.new_database(), tmp_path / "cluster-blobs"
    folder.mkdir()
    replica = start_replica(tmp_path, database, Blobs(folder.as_uri()), "good")
    try:
        with httpx.Client(base_url=replica.base_url, timeout=30) as api:
            batch = submit(api, [chat_line(f"r{i}") for i in range(3)])
            wait_for_status(api, batch["id"], {"completed"})
        mark = folder / CLUSTER_MARK_KEY
        cluster = mark.read_text().strip()

        wrong_folder = tmp_path / "another-folder"
        wrong_folder.mkdir()
        paragraph = _refused(tmp_path / "stray-1", database, wrong_folder)
        assert f"database belongs to cluster {cluster}" in paragraph and "no cluster mark" in paragraph
        assert "--blob-url" in paragraph and str(wrong_folder) in paragraph
        assert not list(wrong_folder.rglob("*.jsonl"))  # it wrote nothing there

        paragraph = _refused(tmp_path / "stray-2", postgres_server.new_database(), folder)
        assert f"store belongs to cluster {cluster}" in paragraph and "--metadata-url" in paragraph

        # the running replica's folder loses its mark (another folder mounted there, say)
        mark.rename(folder / "moved-away")
        sick = _wait_for_health(replica.base_url, 503)
        assert sick.status_code == 503 and "no cluster mark" in sick.text, sick.text
        (folder / "moved-away").rename(mark)
        assert _wait_for_health(replica.base_url, 200).status_code == 200
    finally:
        replica.stop()
