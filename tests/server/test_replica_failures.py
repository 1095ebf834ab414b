"""Real ``batchgen-server`` replicas killed and paused mid-batch: every line still exactly once.

Three replicas (``--metadata-url``, ``--blob-url`` over a shared folder and over a real S3 server,
the simulated backend at 0.5 s a request, 200 slots each, a 3 s lease) and the real ``openai`` SDK:

- a 30,000-request batch, and a 300-request batch created behind it. The replica holding the most
  shards (its ``/health``) is killed with SIGKILL three times at random moments and started again
  each time, then two of the three at once. Both batches end ``completed``; every custom_id has
  exactly one line; ``request_counts`` equal the lines; the small batch ends first. Meanwhile
  the output is downloaded now and then from a random replica (every earlier download is a
  prefix of every later one: nothing uncommitted is ever served), and every committed segment is
  hashed when it appears and is unchanged at the end.
- a zombie: the busiest replica paused with SIGSTOP for twice the lease while the others take its
  shards, then continued: it loses those leases (its ``/health`` says so), nothing it committed
  late counts, and no line is doubled.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.replica_fleet import (
    Blobs,
    Fleet,
    SegmentHashes,
    client,
    committed_once,
    create,
    downloads_grow,
    ended,
    every_line_once,
    report,
    running_fleet,
)

pytestmark = pytest.mark.live

LEASE_S = 3.0


@pytest.fixture
def fleet(postgres_url: str, tmp_path: Path, blobs: Blobs) -> Iterator[Fleet]:
    """Three replicas over ``blobs`` (a shared folder, then S3: ``tests/server/conftest.py``)."""
    with running_fleet(postgres_url, tmp_path, blobs, lease_s=LEASE_S) as replicas:
        yield replicas


def test_replicas_killed_three_times_and_two_at_once_lose_no_line_and_double_none(
    fleet: Fleet, tmp_path: Path
) -> None:
    big = create(fleet.servers["a"], tmp_path / "big.jsonl", 30_000, "big-")
    small = create(fleet.servers["b"], tmp_path / "small.jsonl", 300, "small-")
    seen: list[bytes] = []
    with SegmentHashes(fleet.url, fleet.blobs, big) as hashes:
        for _ in range(3):
            time.sleep(random.uniform(1.0, 4.0))
            victim = fleet.busiest()
            fleet.kill(victim)
            fleet.start(victim)
            downloads_grow(fleet, client(fleet.any()).batches.retrieve(big).output_file_id, seen)
        time.sleep(random.uniform(1.0, 3.0))
        pair = random.sample(sorted(fleet.servers), 2)
        for name in pair:
            fleet.kill(name)
        for name in pair:
            fleet.start(name)
        small_end = ended(fleet, small, [], 120)
        big_end = ended(fleet, big, seen, 300)
    every_line_once(fleet, small_end, 300, "small-")
    every_line_once(fleet, big_end, 30_000, "big-")
    assert small_end["completed_at"] <= big_end["completed_at"]
    assert len(seen) >= 4 and seen[-1].count(b"\n") == 30_000
    assert hashes.unchanged() > 30_000 // 512  # at least a segment per shard, each hashed in the run


def test_a_paused_replica_loses_its_shards_and_its_late_work_never_counts(
    fleet: Fleet, tmp_path: Path
) -> None:
    batch_id = create(fleet.servers["a"], tmp_path / "input.jsonl", 12_000, "r")
    time.sleep(2.0)
    zombie = fleet.busiest()
    before = report(fleet.servers[zombie])
    assert before["shards_held"] > 0
    fleet.servers[zombie].process.send_signal(signal.SIGSTOP)
    time.sleep(2 * LEASE_S)
    fleet.servers[zombie].process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 3 * LEASE_S
    while (after := report(fleet.servers[zombie]))["leases_lost"] + after["commits_refused"] == 0:
        assert time.monotonic() < deadline, f"the zombie never let its shards go: {after}"
        time.sleep(0.2)
    batch = ended(fleet, batch_id, [], 180)
    every_line_once(fleet, batch, 12_000, "r")
    committed_once(fleet.servers, 12_000)
