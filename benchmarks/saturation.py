"""Saturation and fairness: does the engine stay busy while work is queued, and do small batches wait?

The simulated backend with 10,240 slots and per-request latencies spread over about 0.6 to 1.5 s
(0.5 s plus 20 ms per output token, 4 to 48 tokens). A huge batch is queued, then a small one.

- ``busy_share``: the share of slot-time during which the engine is actually working on a request
  (inside ``generate``), measured from the moment every slot is first filled until the intake pool
  is empty. Time a slot spends waiting for the control plane (reading the next line, writing the
  result) counts as idle. Target: at least 0.98.
- Fairness: the small batch is created after the huge one; ``small_batch_wait_s`` is how long it
  took to finish, next to ``small_batch_alone_s``, the same small batch on an idle service.

    python benchmarks/saturation.py [--huge 100000] [--small 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import anyio

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends import Outcome, ReportOutcome
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.models import GenerationRequest, GenerationResult

SLOTS = 10_240


class BusyMeter(SimulatedBackend):
    """The simulated backend, integrating how many requests are inside ``generate`` (or a
    ``generate_many`` call, until each is reported) over time."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.busy = 0
        self.busy_seconds = 0.0
        self._since = time.perf_counter()

    def _tick(self, change: int) -> None:
        now = time.perf_counter()
        self.busy_seconds += self.busy * (now - self._since)
        self._since = now
        self.busy += change

    def integral(self) -> float:
        self._tick(0)
        return self.busy_seconds

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._tick(+1)
        try:
            return await super().generate(request)
        finally:
            self._tick(-1)

    async def generate_many(self, requests: Sequence[GenerationRequest], report: ReportOutcome) -> None:
        # Without a capacity limit, on asyncio, the simulated generate_many never calls generate.
        unreported = set(range(len(requests)))
        self._tick(+len(requests))

        def metered(position: int, outcome: Outcome) -> None:
            unreported.discard(position)
            self._tick(-1)
            report(position, outcome)

        try:
            await super().generate_many(requests, metered)
        finally:
            self._tick(-len(unreported))


def batch_file(name: str, count: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{name}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"{name} question {i}"}]},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


async def run(storage: Path, huge: int, small: int) -> dict[str, float]:
    backend = BusyMeter(latency_s=0.5, token_latency_s=0.02)
    settings = ServiceSettings(storage_path=storage, max_pool_size=SLOTS, max_intake_capacity=1_000_000)
    async with BatchService(settings, backend) as service:
        small_file = await service.create_file(batch_file("small", small))
        started = time.perf_counter()
        alone = await service.create_batch(small_file.id, "/v1/chat/completions")
        await service.wait_for_batch(alone.id, poll_interval=0.01)
        small_alone_s = time.perf_counter() - started

        huge_file = await service.create_file(batch_file("huge", huge))
        small_again = await service.create_file(batch_file("small-2", small))
        huge_batch = await service.create_batch(huge_file.id, "/v1/chat/completions")
        while service.scheduling_pool.active < SLOTS:  # wait until every slot is first filled
            await anyio.sleep(0.001)
        window_start, busy_start = time.perf_counter(), backend.integral()
        small_started = time.perf_counter()
        small_batch = await service.create_batch(small_again.id, "/v1/chat/completions")
        small_done_s: float | None = None
        while service.intake_pool.size or small_done_s is None:
            if small_done_s is None and (await service.get_batch(small_batch.id)).status.is_terminal:
                small_done_s = time.perf_counter() - small_started
            if service.intake_pool.size:
                window_end, busy_end = time.perf_counter(), backend.integral()
            await anyio.sleep(0.005)
        await service.wait_for_batch(huge_batch.id, poll_interval=0.05)
    queued_s = window_end - window_start
    return {
        "huge_requests": huge,
        "small_requests": small,
        "slots": SLOTS,
        "queued_window_s": round(queued_s, 2),
        "busy_share": round((busy_end - busy_start) / (SLOTS * queued_s), 4),
        "small_batch_wait_s": round(small_done_s, 2),
        "small_batch_alone_s": round(small_alone_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--huge", type=int, default=100_000, help="requests in the huge batch")
    parser.add_argument("--small", type=int, default=200, help="requests in the small batch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        figures = anyio.run(run, Path(folder), args.huge, args.small)
    print(
        f"engine busy share while requests were queued: {figures['busy_share']} "
        f"(over {figures['queued_window_s']} s, {SLOTS} slots; target >= 0.98)"
    )
    print(
        f"small batch of {args.small} behind a huge one of {args.huge}: finished in "
        f"{figures['small_batch_wait_s']} s (alone on an idle service: {figures['small_batch_alone_s']} s)"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
