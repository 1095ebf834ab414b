"""Intake memory: what 1,000,000 queued requests cost in memory, and how long accepting them takes.

Uploads one batch of N chat requests (chat_inputs.write_chat_input, as control_plane.py) to an embedded BatchService whose simulated backend holds
every admitted request for an hour (16 slots), so almost the whole batch waits in the intake pool.
Measures the resident memory (RSS) just before ``create_batch`` and once the batch is queued, and
the time from ``create_batch`` to ``in_progress`` (indexing the file and queueing every line).
Target: 1,000,000 queued requests in at most 1 GiB of extra RSS.

    python benchmarks/intake_memory.py [--requests 1000000]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import anyio
from chat_inputs import write_chat_input

from batchgen.core import BatchService, BatchStatus, ServiceSettings, load_backend


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024


async def run(folder: Path, count: int) -> dict[str, float]:
    input_path = folder / "input.jsonl"
    write_chat_input(input_path, count)
    settings = ServiceSettings(storage_path=folder / "storage", max_pool_size=16, max_intake_capacity=count)
    async with BatchService(settings, load_backend("simulated", latency_s=3600.0)) as service:
        file = await service.create_file(input_path)
        gc.collect()
        before = rss_mib()
        started = time.perf_counter()
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        while (await service.get_batch(batch.id)).status is BatchStatus.VALIDATING:
            await anyio.sleep(0.01)
        accepted_s = time.perf_counter() - started
        gc.collect()
        after = rss_mib()
        queued = service.intake_pool.size
        await service.cancel_batch(batch.id)
    return {
        "requests": count,
        "input_mb": round(input_path.stat().st_size / 1e6, 1),
        "queued": queued,
        "accept_s": round(accepted_s, 2),
        "rss_before_mib": round(before),
        "rss_after_mib": round(after),
        "rss_growth_mib": round(after - before, 1),
        "bytes_per_queued_request": round((after - before) * 1024 * 1024 / max(queued, 1), 1),
        "peak_rss_mib": round(rss_mib("VmHWM")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        figures = anyio.run(run, Path(folder), args.requests)
    print(
        f"{figures['queued']:,} requests queued in {figures['accept_s']} s; RSS grew by "
        f"{figures['rss_growth_mib']} MiB ({figures['bytes_per_queued_request']} bytes per request; "
        f"target <= 1024 MiB); peak RSS {figures['peak_rss_mib']} MiB"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
