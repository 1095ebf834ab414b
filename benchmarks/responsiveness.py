"""Responsiveness under load: how long ``/health`` and ``GET /v1/batches/{id}`` take while batches run.

Starts a ``batchgen-server`` subprocess and, while it runs a batch, polls ``/health`` and the batch
every 20 ms from two threads (one client each), recording each call's latency. Scenarios:

- ``zero_latency``: a 100,000-request chat batch on the simulated backend at zero latency, so the
  service's own work is all the load there is;
- ``huge_prompt``: one request whose prompt is 50 MB, on the simulated backend;
- ``model`` (with ``--model-batch``; needs torch): a batch of SmolLM2 requests on the default
  transformers backend.

Prints p50/p99/max per endpoint and scenario, then one JSON object with them as the last line.

    python benchmarks/responsiveness.py [--requests 100000] [--prompt-mb 50] [--model-batch]
                                        [--server-flag=--api-nice=10 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from running_server import TERMINAL, running_server

POLL_INTERVAL_S = 0.02


def chat_lines(count: int, *, content: str | None = None, max_tokens: int | None = None) -> bytes:
    lines = []
    for i in range(count):
        body: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "user", "content": content or f"Question {i}"}],
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        lines.append(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


def _poll(base_url: str, path: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get(path).raise_for_status()
            took = time.perf_counter() - started
            latencies.append(took)
            stop.wait(max(0.0, POLL_INTERVAL_S - took))


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _summary(latencies: list[float]) -> dict[str, float]:
    return {
        "samples": len(latencies),
        "p50_ms": round(_percentile(latencies, 0.50) * 1000, 1),
        "p99_ms": round(_percentile(latencies, 0.99) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
    }


def probe_batch(client: httpx.Client, content: bytes) -> dict[str, Any]:
    """Upload ``content``, create its batch, and poll both endpoints until the batch ends."""
    file_id = client.post(
        "/v1/files", files={"file": ("input.jsonl", content)}, data={"purpose": "batch"}
    ).json()["id"]
    batch = client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    ).json()
    base_url = str(client.base_url)
    stop = threading.Event()
    health: list[float] = []
    batch_get: list[float] = []
    pollers = [
        threading.Thread(target=_poll, args=(base_url, "/health", stop, health)),
        threading.Thread(target=_poll, args=(base_url, f"/v1/batches/{batch['id']}", stop, batch_get)),
    ]
    started = time.perf_counter()
    for poller in pollers:
        poller.start()
    try:
        while batch["status"] not in TERMINAL:
            time.sleep(0.2)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
    finally:
        stop.set()
        for poller in pollers:
            poller.join()
    assert batch["status"] == "completed", batch
    return {
        "requests": batch["request_counts"]["total"],
        "run_s": round(time.perf_counter() - started, 2),
        "health": _summary(health),
        "batch_get": _summary(batch_get),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000, help="requests in the zero-latency batch")
    parser.add_argument("--prompt-mb", type=int, default=50, help="size of the huge prompt (0: skip)")
    parser.add_argument("--model-batch", action="store_true", help="also probe a SmolLM2 batch (needs torch)")
    parser.add_argument("--model-requests", type=int, default=32)
    parser.add_argument("--server-flag", action="append", default=[], help="one more batchgen-server flag")
    args = parser.parse_args()
    figures: dict[str, Any] = {"poll_interval_ms": POLL_INTERVAL_S * 1000, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        with running_server(root / "simulated", 10992, "--backend", "simulated", *args.server_flag) as (
            _,
            client,
        ):
            figures["zero_latency"] = probe_batch(client, chat_lines(args.requests))
            if args.prompt_mb:
                huge = chat_lines(1, content="word " * (args.prompt_mb * 1024 * 1024 // 5), max_tokens=16)
                figures["huge_prompt"] = probe_batch(client, huge)
        if args.model_batch:
            with running_server(root / "model", 10993, "--backend", "transformers", *args.server_flag) as (
                _,
                client,
            ):
                figures["model"] = probe_batch(client, chat_lines(args.model_requests, max_tokens=32))
    for scenario in ("zero_latency", "huge_prompt", "model"):
        if scenario not in figures:
            continue
        result = figures[scenario]
        for endpoint in ("health", "batch_get"):
            s = result[endpoint]
            print(
                f"{scenario:>12} {endpoint:>9}: p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms  "
                f"max {s['max_ms']:7.1f} ms  ({s['samples']} polls over {result['run_s']} s)"
            )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
