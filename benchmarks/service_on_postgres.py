"""The embedded service on PostgreSQL against SQLite: a batch's speed and the API's calls.

One process, the simulated backend at zero latency (so the control plane is all there is to
measure), file contents on the local disk either way. For each store, in alternating order, a
fresh service runs one batch of ``--requests`` chat lines (requests/s from create to
``completed``), then times ``--polls`` API calls on it: ``get_batch`` of the ended batch (its row,
read from the store), ``list_batches`` and ``get_file`` (microseconds per call, as the caller
sees them). On SQLite the calls run in place on the event loop; on PostgreSQL each goes to a
worker thread (``MetadataCalls``), which is part of what it costs. Medians of ``--rounds``; a
PostgreSQL this script starts from the machine's own programs, on 127.0.0.1.

    python benchmarks/service_on_postgres.py [--requests 20000] [--polls 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from chat_inputs import write_chat_input
from vllm_overhead import cpu_name

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.storage import MetadataStore, SQLiteMetadataStore
from batchgen.core.storage.postgres_metadata import PostgresMetadataStore

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's PostgreSQL launcher

from tests.postgres import PostgresServer  # noqa: E402

CHAT = "/v1/chat/completions"
CALLS = ("get_batch", "list_batches", "get_file")


async def _per_call_us(call: Callable[[], Awaitable[object]], times: int) -> float:
    started = time.perf_counter()
    for _ in range(times):
        await call()
    return (time.perf_counter() - started) / times * 1e6


async def one_round(
    folder: Path, input_path: Path, open_metadata: Callable[[Path], MetadataStore], polls: int
) -> dict[str, float]:
    settings = ServiceSettings(storage_path=folder, max_pool_size=256)
    async with BatchService(
        settings, SimulatedBackend(latency_s=0.0), open_metadata=open_metadata
    ) as service:
        file = await service.create_file(input_path)
        started = time.perf_counter()
        batch = await service.create_batch(file.id, CHAT)
        await service.wait_for_batch(batch.id, poll_interval=0.01)
        elapsed = time.perf_counter() - started
        while batch.id in service.parts.tracker:  # its last save landed: polls read the store
            await anyio.sleep(0.01)
        figures = {"requests_per_s": file.line_count / elapsed}
        figures["get_batch"] = await _per_call_us(lambda: service.get_batch(batch.id), polls)
        figures["list_batches"] = await _per_call_us(lambda: service.list_batches(limit=20), polls)
        figures["get_file"] = await _per_call_us(lambda: service.get_file(file.id), polls)
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--polls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    server = PostgresServer.start()
    results: dict[str, list[dict[str, float]]] = {"sqlite": [], "postgres": []}
    try:
        with tempfile.TemporaryDirectory(prefix="batchgen-service-pg-") as scratch:
            input_path = Path(scratch) / "input.jsonl"
            write_chat_input(input_path, arguments.requests)
            for round_number in range(arguments.rounds):
                for name in sorted(results, reverse=round_number % 2 == 1):  # alternate the order
                    url = server.new_database()
                    openers: dict[str, Callable[[Path], MetadataStore]] = {
                        "sqlite": SQLiteMetadataStore,
                        "postgres": lambda _path, url=url: PostgresMetadataStore(url),
                    }
                    folder = Path(scratch) / f"{name}-{round_number}"
                    folder.mkdir()
                    figures = anyio.run(one_round, folder, input_path, openers[name], arguments.polls)
                    results[name].append(figures)
                    line = ", ".join(f"{key} {value:,.0f}" for key, value in figures.items())
                    print(f"round {round_number + 1}, {name}: {line} (calls in us)", flush=True)
    finally:
        server.stop()
        server.remove()
    medians = {
        name: {key: round(statistics.median(run[key] for run in runs), 1) for key in runs[0]}
        for name, runs in results.items()
    }
    sqlite, postgres = medians["sqlite"], medians["postgres"]
    print(
        f"batch: sqlite {sqlite['requests_per_s']:,.0f} requests/s, postgres {postgres['requests_per_s']:,.0f} "
        f"({postgres['requests_per_s'] / sqlite['requests_per_s']:.2f}x)"
    )
    for call in CALLS:
        print(
            f"{call}: sqlite {sqlite[call]:.0f} us, postgres {postgres[call]:.0f} us ({postgres[call] / sqlite[call]:.1f}x)"
        )
    print(
        json.dumps(
            {
                "benchmark": "service_on_postgres",
                "cpu": cpu_name(),
                "cores": os.cpu_count(),
                "requests": arguments.requests,
                "polls": arguments.polls,
                "rounds": arguments.rounds,
                "medians": medians,
                "postgres_to_sqlite_requests_per_s": round(
                    postgres["requests_per_s"] / sqlite["requests_per_s"], 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
