"""Control-plane throughput: how fast the service moves requests when inference costs nothing.

Runs N chat requests through the simulated backend at zero latency, embedded (BatchService in this
process) and end to end through the REST API (a batchgen-server subprocess on 127.0.0.1), and
measures a floor in the same run: one loop that reads the same input, parses each line, builds the
same output line with the same JSON codec and appends it to a file. Upload + validation is the
median of three uploads of the input (the first, on a service that has just started, is reported
too); the batch runs from the last. Prints the figures, then one JSON object with them as the last
line.

    python benchmarks/control_plane.py [--requests 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import msgspec
from chat_inputs import write_chat_input
from running_server import peak_rss_mib, run_batch, running_server, upload

from batchgen.core import BatchService, ServiceSettings, load_backend
from batchgen.core.models import GenerationResult
from batchgen.core.requests.results import output_line


def floor_rate(input_path: Path, output_path: Path) -> float:
    """Requests per second of the minimal read-parse-build-append loop."""
    decode = msgspec.json.Decoder().decode
    result = GenerationResult(text="four", finish_reason="stop", prompt_tokens=9, completion_tokens=1)
    start = time.perf_counter()
    count = 0
    with input_path.open("rb") as source, output_path.open("ab") as sink:
        for raw in source:
            line = decode(raw)
            sink.write(output_line(line["custom_id"], "req_x", line["url"], "simulated", result, 0))
            sink.flush()
            count += 1
    return count / (time.perf_counter() - start)


#: Uploads of the input per measurement of upload + validation; the figure is their median.
UPLOADS = 3


async def embedded_rate(input_path: Path, storage: Path, count: int) -> tuple[float, float, float]:
    """(median and first upload MB/s, requests/s end to end) through BatchService in this process."""
    size_mb = input_path.stat().st_size / 1e6
    async with BatchService(ServiceSettings(storage_path=storage), load_backend("simulated")) as service:
        upload_rates = []
        for _ in range(UPLOADS):
            start = time.perf_counter()
            file = await service.create_file(input_path)
            upload_rates.append(size_mb / (time.perf_counter() - start))
        uploaded = time.perf_counter()
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        batch = await service.wait_for_batch(batch.id, poll_interval=0.01)
        done = time.perf_counter()
        assert batch.request_counts.completed == count, batch.request_counts
    return statistics.median(upload_rates), upload_rates[0], count / (done - uploaded)


def rest_rate(input_path: Path, storage: Path, count: int) -> tuple[float, float, float, float]:
    """(median and first upload MB/s, requests/s, server peak RSS MiB) through a batchgen-server
    subprocess; the batch runs from the last upload."""
    size_mb = input_path.stat().st_size / 1e6
    with running_server(storage, 10990, "--backend", "simulated") as (server, client):
        upload_rates = []
        for _ in range(UPLOADS - 1):
            upload_rates.append(size_mb / upload(client, input_path)[1])
        batch, upload_s, run_s = run_batch(client, input_path)
        upload_rates.append(size_mb / upload_s)
        assert batch["request_counts"]["completed"] == count, batch
        peak = peak_rss_mib(server.pid)
    return statistics.median(upload_rates), upload_rates[0], count / run_s, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000, help="chat requests in the batch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        input_path = root / "input.jsonl"
        write_chat_input(input_path, args.requests)
        input_mb = input_path.stat().st_size / 1e6
        floor = floor_rate(input_path, root / "floor-output.jsonl")
        embedded_upload, embedded_first, embedded = anyio.run(
            embedded_rate, input_path, root / "embedded", args.requests
        )
        rest_upload, rest_first, rest, rest_rss = rest_rate(input_path, root / "rest", args.requests)
    own_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures = {
        "requests": args.requests,
        "input_mb": round(input_mb, 1),
        "floor_requests_per_s": round(floor),
        "embedded_upload_mb_per_s": round(embedded_upload, 1),
        "embedded_first_upload_mb_per_s": round(embedded_first, 1),
        "embedded_requests_per_s": round(embedded),
        "rest_upload_mb_per_s": round(rest_upload, 1),
        "rest_first_upload_mb_per_s": round(rest_first, 1),
        "rest_requests_per_s": round(rest),
        "floor_ratio_embedded": round(embedded / floor, 3),
        "floor_ratio_rest": round(rest / floor, 3),
        "rest_server_peak_rss_mib": round(rest_rss),
        "embedded_process_peak_rss_mib": round(own_rss),
        "cpus": os.cpu_count(),
    }
    print(f"floor loop (read, parse, build, append): {figures['floor_requests_per_s']:>8} requests/s")
    print(
        f"embedded BatchService:                   {figures['embedded_requests_per_s']:>8} requests/s "
        f"(floor ratio {figures['floor_ratio_embedded']}), upload+validate {figures['embedded_upload_mb_per_s']} MB/s "
        f"(first of {UPLOADS}: {figures['embedded_first_upload_mb_per_s']})"
    )
    print(
        f"REST API, batchgen-server:               {figures['rest_requests_per_s']:>8} requests/s "
        f"(floor ratio {figures['floor_ratio_rest']}), upload+validate {figures['rest_upload_mb_per_s']} MB/s "
        f"(first of {UPLOADS}: {figures['rest_first_upload_mb_per_s']}), "
        f"server peak RSS {figures['rest_server_peak_rss_mib']} MiB"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
