"""Takeover: how long a dead replica's shards wait before another replica commits their work.

Three shard-runner replicas (``tests/work_replica.py`` processes: each line takes 50 ms, eight at
a time, up to three shards each) share one batch on a PostgreSQL this script starts from the
machine's own programs. Once replica A holds shards and has committed work, it is killed with
SIGKILL. ``takeover_s`` is the time, on the database's clock, from the kill to the first commit
of one of A's shards by another replica (a segment at a higher epoch), with the runner's default
lease. Target: at most the lease plus 2 s. A lease runs out between ``lease - lease/3`` and
``lease`` after the kill (it was renewed at most a third of a lease before), and the others claim
what is free every 0.1 s when idle, or as soon as one of their shards ends.

    python benchmarks/takeover.py [--rounds 3] [--lease-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from vllm_overhead import cpu_name

from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.shard_runner import DEFAULT_LEASE_S

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's PostgreSQL launcher and replica process

from tests.postgres import PostgresServer  # noqa: E402
from tests.work_replica import launch  # noqa: E402

REPLICAS = ("replica-a", "replica-b", "replica-c")


def _start(
    url: str, folder: Path, name: str, lease_s: float, logs: Path
) -> tuple[subprocess.Popen[bytes], str]:
    options = ["--ttl-s", str(lease_s), "--line-s", "0.05", "--concurrency", "8", "--max-shards", "3"]
    return launch(url, folder.as_uri(), name, logs / f"{name}-{time.monotonic_ns()}.log", options)


async def _share(url: str, batch_id: str, lines: int) -> None:
    async with PostgresShardLedger(url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch(batch_id, lines, shard_lines=50)


def one_round(server: PostgresServer, lease_s: float, work: Path) -> float:
    url = server.new_database()
    folder, logs = work / "shared", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    processes = {}
    batch = "batch_takeover"
    asyncio.run(_share(url, batch, 20_000))
    with psycopg.connect(url, autocommit=True) as db:
        first, owner = _start(url, folder, REPLICAS[0], lease_s, logs)
        processes[REPLICAS[0]] = first
        deadline = time.monotonic() + 60
        for name in REPLICAS[1:]:
            processes[name] = _start(url, folder, name, lease_s, logs)[0]
        # A holds shards and has committed some of their lines: it is in full work
        while True:
            held = db.execute(
                "SELECT shard_no, epoch FROM batch_shards WHERE owner_id = %s AND state = 'leased' "
                "AND cardinality(done_lines) > 0",
                (owner,),
            ).fetchall()
            if held:
                break
            assert time.monotonic() < deadline + 60, "replica A committed nothing"
            time.sleep(0.02)
        held = db.execute(
            "SELECT shard_no, epoch FROM batch_shards WHERE owner_id = %s AND state = 'leased'", (owner,)
        ).fetchall()
        first.kill()
        killed_at = db.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        first.wait()
        while True:
            row = db.execute(
                "SELECT min(committed_at) FROM batch_segments s JOIN unnest(%s::int[], %s::bigint[]) AS a(shard, epoch) "
                "ON s.shard_no = a.shard AND s.epoch > a.epoch WHERE s.batch_id = %s",
                ([shard for shard, _ in held], [epoch for _, epoch in held], batch),
            ).fetchone()
            if row is not None and row[0] is not None:
                taken = row[0]
                break
            assert time.monotonic() < deadline + 120 + lease_s, "nobody took A's shards over"
            time.sleep(0.02)
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    for process in processes.values():
        process.wait(timeout=30)
    return float((taken - killed_at).total_seconds())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S)
    arguments = parser.parse_args()
    server = PostgresServer.start()
    try:
        times = []
        for round_number in range(arguments.rounds):
            with tempfile.TemporaryDirectory(prefix="batchgen-takeover-") as work:
                seconds = one_round(server, arguments.lease_s, Path(work))
            times.append(seconds)
            print(f"round {round_number + 1}: kill -9 to the first commit by another replica {seconds:.2f} s")
    finally:
        server.stop()
        server.remove()
    target = arguments.lease_s + 2
    median = statistics.median(times)
    print(f"lease {arguments.lease_s:g} s: median takeover {median:.2f} s (target <= {target:g} s)")
    figures = {
        "benchmark": "takeover",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "lease_s": arguments.lease_s,
        "takeover_s": [round(t, 3) for t in times],
        "median_takeover_s": round(median, 3),
        "target_s": target,
        "target_met": median <= target,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
