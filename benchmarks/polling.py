"""Polling must not slow generation: the same SmolLM2 batch with nobody, one, and 50 clients polling.

Starts ``batchgen-server`` (transformers backend, its defaults, ``--log-level warning``) on
127.0.0.1, warms it up with a small batch, then runs the same 64 greedy chat requests (up to 64
new tokens each) as one batch three ways:

  (a) nobody polls (this script looks at the batch twice a second to see it end);
  (b) one client polls ``GET /v1/batches/{id}`` in a tight loop, as the README's openai SDK
      loop does;
  (c) 50 clients poll it concurrently, each in a tight loop.

The pollers run in a separate process (one thread per poller, each with its own connection)
and send no ``If-None-Match``: every poll is a full answer, the worst case. Each figure is the
batch's output tokens over the time from its creation to its completion. Prints tokens/s for
each, how many polls were answered, and the ratios b/a and c/a; with ``--rounds N`` the figures
are the medians of N rounds. It also prints the CPU seconds each side used while the batch ran:
the model worker, the API (the server process), and the pollers' process. The last line is one
JSON object with the figures.

    python benchmarks/polling.py [--requests 64] [--max-tokens 64] [--rounds 1] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from model_throughput import chat_batch
from running_server import TERMINAL, running_server, upload

PORT = 10993
SCENARIOS = {"a": 0, "b": 1, "c": 50}
CPU_SIDES = ("worker", "api", "pollers")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the server's model workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError):
                pass
    return found


def poll(base_url: str, batch_id: str, pollers: int, stop: Any, answered: Any, cpu: Any) -> None:
    """In a child process: ``pollers`` threads GET the batch in a tight loop until ``stop`` is set."""
    began = time.process_time()

    def loop() -> None:
        count = 0
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not stop.is_set():
                client.get(f"/v1/batches/{batch_id}").raise_for_status()
                count += 1
        with answered.get_lock():
            answered.value += count

    threads = [threading.Thread(target=loop) for _ in range(pollers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu.value = time.process_time() - began


def run_scenario(client: httpx.Client, server_pid: int, content: bytes, pollers: int) -> dict[str, Any]:
    """One batch with ``pollers`` tight pollers: tokens, seconds, polls answered, CPU seconds used."""
    file_id, _ = upload(client, content)
    context = multiprocessing.get_context("spawn")
    stop, answered, poller_cpu = context.Event(), context.Value("q", 0), context.Value("d", 0.0)
    workers = children(server_pid)
    api_cpu, worker_cpu = cpu_seconds(server_pid), sum(map(cpu_seconds, workers))
    started = time.perf_counter()
    batch = client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    ).json()
    process = None
    if pollers:
        process = context.Process(
            target=poll, args=(str(client.base_url), batch["id"], pollers, stop, answered, poller_cpu)
        )
        process.start()
    while batch["status"] not in TERMINAL:
        time.sleep(0.5)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    elapsed = time.perf_counter() - started
    api_cpu, worker_cpu = cpu_seconds(server_pid) - api_cpu, sum(map(cpu_seconds, workers)) - worker_cpu
    stop.set()
    if process is not None:
        process.join()
    assert batch["status"] == "completed", batch
    tokens = batch["usage"]["output_tokens"]
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "polls": answered.value,
        "cpu_s": {"worker": worker_cpu, "api": api_cpu, "pollers": poller_cpu.value},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat a, b, c this many times; report medians"
    )
    parser.add_argument(
        "--model", default=None, help="a Hugging Face folder or GGUF (default: packaged SmolLM2)"
    )
    parser.add_argument(
        "--storage-path",
        default=None,
        help="server storage (holds the converted model cache); default: a temp dir",
    )
    parser.add_argument("--server-flag", action="append", default=[], help="one more batchgen-server flag")
    args = parser.parse_args()
    flags = ["--backend", "transformers", *args.server_flag]
    if args.model:
        flags += ["--model", args.model]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SCENARIOS}
    with tempfile.TemporaryDirectory() as scratch:
        storage = Path(args.storage_path or scratch)
        with running_server(storage, PORT, *flags) as (server, client):
            run_scenario(client, server.pid, chat_batch(8, 8, "warm-up-"), 0)
            for round_number in range(args.rounds):
                for name, pollers in SCENARIOS.items():
                    content = chat_batch(args.requests, args.max_tokens, f"{name}{round_number}-")
                    result = run_scenario(client, server.pid, content, pollers)
                    runs[name].append(result)
                    print(
                        f"round {round_number + 1} ({name}) {pollers:2d} pollers: "
                        f"{result['tokens_per_s']:.1f} tok/s ({result['tokens']} tokens in "
                        f"{result['seconds']:.2f} s, {result['polls']} polls answered; CPU s: "
                        + ", ".join(f"{side} {used:.2f}" for side, used in result["cpu_s"].items())
                        + ")",
                        flush=True,
                    )
    rate = {name: statistics.median(run["tokens_per_s"] for run in results) for name, results in runs.items()}
    polls = {name: statistics.median(run["polls"] for run in results) for name, results in runs.items()}
    cpu = {
        name: {side: round(statistics.median(run["cpu_s"][side] for run in results), 2) for side in CPU_SIDES}
        for name, results in runs.items()
    }
    figures = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "tokens": runs["a"][0]["tokens"],
        "a_tokens_per_s": round(rate["a"], 1),
        "b_tokens_per_s": round(rate["b"], 1),
        "c_tokens_per_s": round(rate["c"], 1),
        "b_polls": polls["b"],
        "c_polls": polls["c"],
        "ratio_b_a": round(rate["b"] / rate["a"], 3),
        "ratio_c_a": round(rate["c"] / rate["a"], 3),
        "cpu_s": cpu,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(f"(a) nobody polling:     {figures['a_tokens_per_s']} tok/s")
    print(f"(b) one tight poller:   {figures['b_tokens_per_s']} tok/s  b/a = {figures['ratio_b_a']}")
    print(f"(c) 50 tight pollers:   {figures['c_tokens_per_s']} tok/s  c/a = {figures['ratio_c_a']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
