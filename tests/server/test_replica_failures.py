"""Real ``batchgen-server`` replicas killed and paused mid-batch: every line still exactly once.

Three replicas (``--metadata-url``, ``--blob-url``, the simulated backend at 0.5 s a request, 200
slots each, a 3 s lease) and the real ``openai`` SDK:

- a 30,000-request batch, and a 300-request batch created behind it. The replica holding the most
  shards (its ``/health``) is killed with SIGKILL three times at random moments and started again
  each time, then two of the three at once. Both batches end ``completed``; every custom_id has
  exactly one line; ``request_counts`` equal the lines; the small batch ends first. Meanwhile
  the output is downloaded now and then from a random replica: every earlier download is a prefix
  of every later one (committed bytes never change, and nothing uncommitted is ever served).
- a zombie: the busiest replica paused with SIGSTOP for twice the lease while the others take its
  shards, then continued: it loses those leases (its ``/health`` says so), nothing it committed
  late counts, and no line is doubled.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.helpers import chat_line, jsonl
from tests.live import LiveServer, start_server

pytestmark = pytest.mark.live

LEASE_S = 3.0


class _Fleet:
    """Replicas by name, started and restarted on one database and one shared folder."""

    def __init__(self, url: str, root: Path) -> None:
        self.url, self.root = url, root
        self.servers: dict[str, LiveServer] = {}

    def start(self, name: str) -> LiveServer:
        self.servers[name] = start_server(
            self.root / name,
            "--metadata-url",
            self.url,
            "--blob-url",
            f"file://{self.root / 'shared'}",
            "--replica-id",
            name,
            "--lease-s",
            str(LEASE_S),
            "--max-pool-size",
            "200",
            "--simulated-latency-s",
            "0.5",
        )
        return self.servers[name]

    def kill(self, name: str) -> None:
        process = self.servers[name].process
        process.send_signal(signal.SIGKILL)
        process.wait()

    def busiest(self) -> str:
        """The running replica holding the most shards now."""
        held = {name: _report(server)["shards_held"] for name, server in self.servers.items()}
        return max(held, key=lambda name: held[name])

    def any(self) -> LiveServer:
        return random.choice(list(self.servers.values()))

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def _report(server: LiveServer) -> dict:
    return dict(httpx.get(f"{server.base_url}/health", timeout=10).json()["replica"])


@pytest.fixture
def fleet(postgres_url: str, tmp_path: Path) -> Iterator[_Fleet]:
    replicas = _Fleet(postgres_url, tmp_path)
    try:
        for name in ("a", "b", "c"):
            replicas.start(name)
        yield replicas
    finally:
        replicas.stop()


def _create(client: OpenAI, path: Path, lines: int, prefix: str) -> str:
    path.write_bytes(jsonl(*(chat_line(f"{prefix}{i}") for i in range(lines))))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def _client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.api_url, api_key="unused", max_retries=5)


def _downloads_grow(fleet: _Fleet, file_id: str | None, seen: list[bytes]) -> None:
    """Download the output from a random replica; it must extend what was downloaded before."""
    if file_id is None:
        return
    now = httpx.get(f"{fleet.any().api_url}/files/{file_id}/content", timeout=30).content
    assert not seen or now.startswith(seen[-1]), "committed bytes changed, or uncommitted ones were served"
    seen.append(now)


def _ended(fleet: _Fleet, batch_id: str, seen: list[bytes], timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = _client(fleet.any()).batches.retrieve(batch_id).model_dump()
        _downloads_grow(fleet, batch["output_file_id"], seen)
        if batch["status"] not in ("validating", "in_progress", "finalizing"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)


def _every_line_once(fleet: _Fleet, batch: dict, lines: int, prefix: str) -> None:
    assert batch["status"] == "completed", batch
    output = httpx.get(f"{fleet.any().api_url}/files/{batch['output_file_id']}/content", timeout=60).content
    ids = Counter(json.loads(line)["custom_id"] for line in output.splitlines())
    assert ids == Counter(f"{prefix}{i}" for i in range(lines))
    counts = batch["request_counts"]
    assert (counts["completed"], counts["failed"], counts["total"]) == (lines, 0, lines)


def test_replicas_killed_three_times_and_two_at_once_lose_no_line_and_double_none(
    fleet: _Fleet, tmp_path: Path
) -> None:
    client = _client(fleet.servers["a"])
    big = _create(client, tmp_path / "big.jsonl", 30_000, "big-")
    small = _create(_client(fleet.servers["b"]), tmp_path / "small.jsonl", 300, "small-")
    seen: list[bytes] = []
    for _ in range(3):
        time.sleep(random.uniform(1.0, 4.0))
        victim = fleet.busiest()
        fleet.kill(victim)
        fleet.start(victim)
        _downloads_grow(fleet, _client(fleet.any()).batches.retrieve(big).output_file_id, seen)
    time.sleep(random.uniform(1.0, 3.0))
    pair = random.sample(sorted(fleet.servers), 2)
    for name in pair:
        fleet.kill(name)
    for name in pair:
        fleet.start(name)
    small_end = _ended(fleet, small, [], 120)
    big_end = _ended(fleet, big, seen, 300)
    _every_line_once(fleet, small_end, 300, "small-")
    _every_line_once(fleet, big_end, 30_000, "big-")
    assert small_end["completed_at"] <= big_end["completed_at"]
    assert len(seen) >= 4 and seen[-1].count(b"\n") == 30_000


def test_a_paused_replica_loses_its_shards_and_its_late_work_never_counts(
    fleet: _Fleet, tmp_path: Path
) -> None:
    client = _client(fleet.servers["a"])
    batch_id = _create(client, tmp_path / "input.jsonl", 12_000, "r")
    time.sleep(2.0)
    zombie = fleet.busiest()
    before = _report(fleet.servers[zombie])
    assert before["shards_held"] > 0
    fleet.servers[zombie].process.send_signal(signal.SIGSTOP)
    time.sleep(2 * LEASE_S)
    fleet.servers[zombie].process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 3 * LEASE_S
    while (after := _report(fleet.servers[zombie]))["leases_lost"] + after["commits_refused"] == 0:
        assert time.monotonic() < deadline, f"the zombie never let its shards go: {after}"
        time.sleep(0.2)
    ended = _ended(fleet, batch_id, [], 180)
    _every_line_once(fleet, ended, 12_000, "r")
    reports = [_report(server) for server in fleet.servers.values()]
    assert sum(report["lines_committed"] for report in reports) == 12_000
