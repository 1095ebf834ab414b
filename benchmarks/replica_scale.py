"""Scale of the shared work layer: one shard-runner replica against three, side by side in one run.

Each replica is a ``tests/work_replica.py`` process (a ``ShardRunner`` over a ``PostgresShardLedger``
and a shared segment folder) whose lines each take ``--line-s`` seconds (a simulated backend at
that latency) with ``--slots`` lines in flight per replica. One batch of ``--requests`` lines is
added once every replica is ready; the time is from then to the batch's last commit, on the
database's clock. Reported per setting: requests per second, and what the run cost the
database and the store (transactions committed and segments written, in total and per second).
Target (issue 21): three replicas at least 2.5x one replica's requests per second.

This measures the work layer alone (claims, renewals, fenced commits, segment files), not yet
``batchgen-server`` processes, which do not run their batches through it yet.

    python benchmarks/replica_scale.py [--requests 60000] [--line-s 0.2] [--slots 200] [--rounds 3]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's PostgreSQL launcher and replica process

from tests.postgres import PostgresServer  # noqa: E402
from tests.work_replica import launch  # noqa: E402


def _start(
    url: str, folder: Path, name: str, arguments: argparse.Namespace, logs: Path
) -> subprocess.Popen[bytes]:
    options = [
        *("--line-s", str(arguments.line_s), "--concurrency", str(arguments.slots)),
        *("--max-shards", "2", "--error-every", "0", "--ttl-s", "10", "--commit-interval-s", "1"),
    ]
    return launch(url, folder.as_uri(), name, logs / f"{name}.log", options)[0]


async def _schema(url: str) -> None:
    async with PostgresShardLedger(url) as ledger:
        await ledger.create_schema()


async def _add(url: str, batch_id: str, lines: int) -> None:
    async with PostgresShardLedger(url) as ledger:
        await ledger.add_batch(batch_id, lines)


def _commits(db: psycopg.Connection[tuple[object, ...]]) -> int:
    row = db.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0  # type: ignore[call-overload]


def one_run(
    server: PostgresServer, replicas: int, arguments: argparse.Namespace, work: Path
) -> dict[str, float]:
    url = server.new_database()
    asyncio.run(_schema(url))
    folder, logs = work / "shared", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    processes = [_start(url, folder, f"replica-{n}", arguments, logs) for n in range(replicas)]
    batch = "batch_scale"
    try:
        with psycopg.connect(url, autocommit=True) as db:
            db.execute("SELECT pg_stat_clear_snapshot()")
            before = _commits(db)
            started = db.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
            asyncio.run(_add(url, batch, arguments.requests))
            deadline = time.monotonic() + 30 + 3 * arguments.requests * arguments.line_s / arguments.slots
            while True:
                row = db.execute(
                    "SELECT status, completed, failed FROM batch_work WHERE batch_id = %s", (batch,)
                ).fetchone()
                if row is not None and row[0] == "finished":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the batch did not finish: {row}")
                time.sleep(0.05)
            assert row[1] + row[2] == arguments.requests, row
            ended = db.execute(  # the last commit: when the batch's last line became visible
                "SELECT max(committed_at) FROM batch_segments WHERE batch_id = %s", (batch,)
            ).fetchone()[0]  # type: ignore[index]
            seconds = float((ended - started).total_seconds())
            segments = db.execute(
                "SELECT count(*) FROM batch_segments WHERE batch_id = %s", (batch,)
            ).fetchone()
            db.execute("SELECT pg_stat_clear_snapshot()")
            time.sleep(0.6)  # the statistics collector reports committed transactions every 500 ms
            transactions = _commits(db) - before
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
    objects = int(segments[0]) if segments else 0  # type: ignore[call-overload]
    return {
        "seconds": seconds,
        "requests_per_s": arguments.requests / seconds,
        "transactions": transactions,
        "transactions_per_s": transactions / seconds,
        "segments": objects,
        "segments_per_s": objects / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60_000)
    parser.add_argument("--line-s", type=float, default=0.2)
    parser.add_argument("--slots", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    server = PostgresServer.start()
    results: dict[int, list[dict[str, float]]] = {1: [], 3: []}
    try:
        for round_number in range(arguments.rounds):
            for replicas in (1, 3) if round_number % 2 == 0 else (3, 1):  # alternate the order
                with tempfile.TemporaryDirectory(prefix="batchgen-scale-") as work:
                    run = one_run(server, replicas, arguments, Path(work))
                results[replicas].append(run)
                print(
                    f"round {round_number + 1}, {replicas} replica(s): {run['seconds']:.2f} s, "
                    f"{run['requests_per_s']:.1f} requests/s, {run['transactions_per_s']:.1f} transactions/s, "
                    f"{run['segments_per_s']:.1f} segments/s",
                    flush=True,
                )
    finally:
        server.stop()
        server.remove()

    def median(replicas: int, key: str) -> float:
        return statistics.median(run[key] for run in results[replicas])

    ratio = median(3, "requests_per_s") / median(1, "requests_per_s")
    ideal = arguments.slots / arguments.line_s
    print(
        f"one replica {median(1, 'requests_per_s'):.1f} requests/s, three {median(3, 'requests_per_s'):.1f} "
        f"({ratio:.2f}x; target >= 2.5x); a replica's ceiling is {ideal:.0f} requests/s"
    )
    figures = {
        "benchmark": "replica_scale",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "requests": arguments.requests,
        "line_s": arguments.line_s,
        "slots_per_replica": arguments.slots,
        "rounds": arguments.rounds,
        **{
            f"{replicas}_replica{'s' if replicas > 1 else ''}": {
                "requests_per_s": [round(run["requests_per_s"], 1) for run in results[replicas]],
                "median_requests_per_s": round(median(replicas, "requests_per_s"), 1),
                "median_transactions_per_s": round(median(replicas, "transactions_per_s"), 1),
                "median_segments_per_s": round(median(replicas, "segments_per_s"), 2),
            }
            for replicas in (1, 3)
        },
        "ratio_3_to_1": round(ratio, 3),
        "target": 2.5,
        "target_met": ratio >= 2.5,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
