"""What one metadata call costs: the SQLite store against the PostgreSQL one, side by side.

The service makes its metadata calls from the event loop, so a call's time is time the loop
cannot serve anything else. This times the calls a batch's life makes (an upload's
``insert_file``, a create's ``insert_batch`` with its Idempotency-Key, progress ``save_batch``es,
polls' ``get_batch``, a ``list_batches`` page) on ``SQLiteMetadataStore`` (a file in a temporary
folder) and ``PostgresMetadataStore`` (a PostgreSQL this script starts from the machine's own
programs, on 127.0.0.1), each over ``--batches`` batches, and reports microseconds per call,
medians of ``--rounds``.

    python benchmarks/metadata_cost.py [--batches 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs
from vllm_overhead import cpu_name

from batchgen.core.models import Batch, BatchParameters, BatchStatus, FileObject, RequestCounts
from batchgen.core.storage import MetadataStore, SQLiteMetadataStore
from batchgen.core.storage.interfaces import IdempotencyRecord
from batchgen.core.storage.postgres_metadata import PostgresMetadataStore

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's PostgreSQL launcher

from tests.postgres import PostgresServer  # noqa: E402

CALLS = ("insert_file", "insert_batch", "save_batch", "get_batch", "list_batches")
SAVES_PER_BATCH = 4


def _file(n: int) -> FileObject:
    return FileObject(
        id=f"file-{n}",
        bytes=100,
        created_at=1000,
        filename="in.jsonl",
        purpose="batch",
        path=f"/f/{n}",
        line_count=10,
    )


def _batch(n: int) -> Batch:
    return Batch(
        id=f"batch_{n}",
        endpoint="/v1/chat/completions",
        input_file_id=f"file-{n}",
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=1000,
        expires_at=2000,
        model="m",
        parameters=BatchParameters(max_decoding_length=16, temperature=0.0, top_p=1.0, top_k=0),
        metadata={"job": str(n)},
        request_counts=RequestCounts(total=10),
    )


def one_round(store: MetadataStore, batches: int) -> dict[str, float]:
    """Microseconds per call of each kind, over ``batches`` batches' lives."""
    spent = dict.fromkeys(CALLS, 0.0)
    counts = dict.fromkeys(CALLS, 0)

    def timed(call: Callable[..., object], *args: object, **kwargs: object) -> None:
        name = call.__name__
        started = time.perf_counter()
        call(*args, **kwargs)
        spent[name] += time.perf_counter() - started
        counts[name] += 1

    for n in range(batches):
        timed(store.insert_file, _file(n))
        key = IdempotencyRecord(f"key-{n}", "batch", "fingerprint", 1000)
        timed(store.insert_batch, _batch(n), idempotency=key)
        for done in range(1, SAVES_PER_BATCH + 1):
            saved = attrs.evolve(
                _batch(n), status=BatchStatus.IN_PROGRESS, request_counts=RequestCounts(10, done, 0)
            )
            timed(store.save_batch, saved)
            timed(store.get_batch, f"batch_{n}")
        timed(store.list_batches, after=None, limit=20)
    return {name: spent[name] / counts[name] * 1e6 for name in CALLS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    server = PostgresServer.start()
    results: dict[str, list[dict[str, float]]] = {"sqlite": [], "postgres": []}
    try:
        for round_number in range(arguments.rounds):
            with tempfile.TemporaryDirectory(prefix="batchgen-metadata-") as folder:
                stores: dict[str, Callable[[], MetadataStore]] = {
                    "sqlite": lambda: SQLiteMetadataStore(Path(folder) / "metadata.sqlite3"),
                    "postgres": lambda: PostgresMetadataStore(server.new_database()),
                }
                for name in sorted(stores, reverse=round_number % 2 == 1):  # alternate the order
                    store = stores[name]()
                    try:
                        results[name].append(one_round(store, arguments.batches))
                    finally:
                        store.close()
                    line = ", ".join(f"{call} {us:.0f}" for call, us in results[name][-1].items())
                    print(f"round {round_number + 1}, {name}: {line} (us per call)", flush=True)
    finally:
        server.stop()
        server.remove()
    medians = {
        name: {call: round(statistics.median(run[call] for run in runs), 1) for call in CALLS}
        for name, runs in results.items()
    }
    for call in CALLS:
        print(
            f"{call}: sqlite {medians['sqlite'][call]:.0f} us, postgres {medians['postgres'][call]:.0f} us "
            f"({medians['postgres'][call] / medians['sqlite'][call]:.1f}x)"
        )
    figures = {
        "benchmark": "metadata_cost",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "batches": arguments.batches,
        "rounds": arguments.rounds,
        "median_us_per_call": medians,
        "postgres_to_sqlite": {
            call: round(medians["postgres"][call] / medians["sqlite"][call], 2) for call in CALLS
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
