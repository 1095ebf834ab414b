"""Uploads API: does a part cost more once many parts were received?

Starts a ``batchgen-server`` subprocess (simulated backend) and sends U uploads (default 4) of P
one-byte parts each (default 1,200), one thread per upload, while another thread polls
``/health``. It reports the median latency of the first 100 parts of every upload (the baseline,
in the same run) and of the last 100, and the slowest ``/health`` answer. A part whose cost grows
with the parts received before it shows a last-100 median well above the first-100 one.
Prints the figures, then one JSON object with them as the last line.

    python benchmarks/upload_part_latency.py [--uploads 4] [--parts 1200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from running_server import free_port, running_server

WINDOW = 100


def send_parts(base_url: str, parts: int) -> list[float]:
    """Create an upload and send it ``parts`` one-byte parts; each part's seconds."""
    latencies: list[float] = []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        upload = client.post(
            "/v1/uploads",
            json={"bytes": parts, "filename": "p.bin", "mime_type": "text/plain", "purpose": "user_data"},
        )
        upload.raise_for_status()
        upload_id = upload.json()["id"]
        for _ in range(parts):
            start = time.perf_counter()
            client.post(f"/v1/uploads/{upload_id}/parts", files={"data": ("p", b"x")}).raise_for_status()
            latencies.append(time.perf_counter() - start)
        client.post(f"/v1/uploads/{upload_id}/cancel").raise_for_status()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploads", type=int, default=4)
    parser.add_argument("--parts", type=int, default=1200)
    args = parser.parse_args()
    port = free_port()
    with (
        tempfile.TemporaryDirectory() as folder,
        running_server(Path(folder) / "storage", port, "--backend", "simulated") as (_, client),
    ):
        done = threading.Event()
        health: list[float] = []

        def poll_health() -> None:
            while not done.is_set():
                start = time.perf_counter()
                client.get("/health")
                health.append(time.perf_counter() - start)
                time.sleep(0.05)

        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        with ThreadPoolExecutor(args.uploads) as pool:
            runs = list(pool.map(lambda _: send_parts(str(client.base_url), args.parts), range(args.uploads)))
        done.set()
        poller.join()
    first = statistics.median(latency for run in runs for latency in run[:WINDOW])
    last = statistics.median(latency for run in runs for latency in run[-WINDOW:])
    figures = {
        "uploads": args.uploads,
        "parts_per_upload": args.parts,
        "median_part_s_first_100": round(first, 4),
        "median_part_s_last_100": round(last, 4),
        "last_over_first": round(last / first, 2),
        "max_health_s": round(max(health, default=0.0), 4),
    }
    for name, value in figures.items():
        print(f"{name}: {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
