"""A replica of the shard runner as a process of its own, for the tests that kill and pause one.

``python -m tests.work_replica URL BLOB_URL REPLICA`` prints ``ready OWNER_ID`` and runs a ``ShardRunner`` over the ledger at URL
and the segment store at BLOB_URL (``file:///...`` or ``s3://...``, credentials from the
environment) until SIGTERM, then prints its leases lost and commits refused as
a JSON line. Each line takes ``--line-s`` seconds and produces
``{"custom_id": "<batch>-<line>", "replica": REPLICA}`` with a response, or with an error for every
line number divisible by ``--error-every`` (``result_line``).

``launch`` starts one as a subprocess (inside a network namespace if given a command prefix) and
waits for its ``ready`` line: the tests and the benchmarks that run replicas share it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_store import open_segment_store
from batchgen.core.work.shard_runner import LineResult, ShardRunner
from batchgen.core.work.shards import ERRORS, OUTPUT

#: The repository root: where ``python -m tests.work_replica`` runs.
REPO = Path(__file__).resolve().parents[1]


def launch(
    url: str,
    blob_url: str,
    owner: str,
    log_path: Path,
    options: Sequence[str] = (),
    *,
    prefix: Sequence[str] = (),
    environ: dict[str, str] | None = None,
    start_timeout_s: float = 60.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a replica (its output to ``log_path``) and wait until it is ready: the process and
    its ledger owner id. ``options`` are this module's flags; ``prefix`` runs it through another
    command (``ip netns exec NAME``)."""
    command = [*prefix, sys.executable, "-m", "tests.work_replica", url, blob_url, owner, *options]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(environ or {})}
        )
    deadline = time.monotonic() + start_timeout_s
    while not log_path.read_text().startswith("ready "):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{owner} did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.05)
    return process, log_path.read_text().split()[1]


def custom_id(batch_id: str, line: int) -> str:
    return f"{batch_id}-{line}"


def result_line(kind: str, **fields: object) -> LineResult:
    """A line of ``kind`` holding ``fields``: a completed request's in the output (``OUTPUT``), a
    failed one's in the errors (``ERRORS``), as the counts tell them apart
    (``requests.line_outcomes``)."""
    if kind == OUTPUT:
        outcome: dict[str, object] = {"response": {"status_code": 200}, "error": None}
    else:
        outcome = {"response": None, "error": {"code": "backend_error", "message": "the test failed it"}}
    return LineResult(kind, (json.dumps({**fields, **outcome}) + "\n").encode())


async def _main(arguments: argparse.Namespace) -> None:
    async def run_line(batch_id: str, line: int) -> LineResult:
        await asyncio.sleep(arguments.line_s)
        kind = ERRORS if arguments.error_every and line % arguments.error_every == 0 else OUTPUT
        return result_line(kind, custom_id=custom_id(batch_id, line), replica=arguments.owner)

    async with PostgresShardLedger(arguments.url) as ledger:
        await ledger.create_schema()
        runner = ShardRunner(
            ledger,
            open_segment_store(arguments.blob_url),
            run_line,
            replica_id=arguments.owner,
            max_shards=arguments.max_shards,
            concurrency=arguments.concurrency,
            ttl_s=arguments.ttl_s,
            commit_interval_s=arguments.commit_interval_s,
            poll_s=0.1,
        )
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, runner.stop)
        print(f"ready {runner.owner_id}", flush=True)
        await runner.run()
        stats = {"leases_lost": runner.leases_lost, "commits_refused": runner.commits_refused}
        print(json.dumps(stats), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("blob_url")
    parser.add_argument("owner")
    parser.add_argument("--line-s", type=float, default=0.02)
    parser.add_argument("--error-every", type=int, default=17)
    parser.add_argument("--max-shards", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ttl-s", type=float, default=2.0)
    parser.add_argument("--commit-interval-s", type=float, default=0.2)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
