"""Result cache: a second run of the same greedy batch, answered from the cache, next to the first.

Starts ``batchgen-server`` subprocesses on the simulated backend and runs N greedy chat requests
through the REST API three times: on a server without the cache (the baseline: what a run costs
today), then twice on a server whose ``default`` tenant uses it (``--result-cache-tenant
default``): the first run computes every answer and stores it, the second is answered from the
cache. ``--latency-s`` gives each simulated request a cost (0: inference costs nothing, so the
figures compare the cache with the service's own work). It checks that the second run's response
bodies are the first run's byte for byte (but for usage's ``cached_tokens``, which a replayed
line sets to all its prompt tokens), prints the figures, then one JSON object with them as the
last line.

    python benchmarks/result_cache.py [--requests 100000] [--latency-s 0.0]
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
from chat_inputs import write_chat_input
from running_server import free_port, peak_rss_mib, running_server, upload

TERMINAL = ("completed", "failed", "cancelled", "expired")


class _Response(msgspec.Struct):
    body: msgspec.Raw


class _Line(msgspec.Struct):
    custom_id: str
    response: _Response | None
    cached: bool = False


_CACHED_TOKENS = re.compile(rb'"cached_tokens":\d+')


def as_replayed(body: bytes) -> bytes:
    """A first run's chat body as a replay holds it: ``cached_tokens`` (usage's, the last one)
    is its prompt tokens."""
    *_, last = _CACHED_TOKENS.finditer(body)
    prompt = json.loads(body)["usage"]["prompt_tokens"]
    return body[: last.start()] + b'"cached_tokens":%d' % prompt + body[last.end() :]


def run(client: httpx.Client, input_path: Path) -> tuple[dict[str, object], float, dict[str, bytes], int]:
    """Run the input as one batch: the batch, the seconds from create to its end, the response
    bodies by custom_id, and how many lines say they came from the cache."""
    file_id, _ = upload(client, input_path)
    started = time.perf_counter()
    batch = client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    ).json()
    while batch["status"] not in TERMINAL:
        time.sleep(0.02)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    seconds = time.perf_counter() - started
    assert batch["status"] == "completed", batch
    content = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    lines = [msgspec.json.decode(raw, type=_Line) for raw in content.splitlines()]
    bodies = {line.custom_id: bytes(line.response.body) for line in lines if line.response is not None}
    return batch, seconds, bodies, sum(line.cached for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000, help="greedy chat requests per run")
    parser.add_argument("--latency-s", type=float, default=0.0, help="simulated seconds per request")
    args = parser.parse_args()
    flags = ("--backend", "simulated", "--simulated-latency-s", str(args.latency_s))
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        input_path = root / "input.jsonl"
        write_chat_input(input_path, args.requests, lambda i: {"temperature": 0})
        with running_server(root / "plain", free_port(), *flags) as (_, client):
            _, baseline_s, _, _ = run(client, input_path)
        with running_server(root / "cached", free_port(), *flags, "--result-cache-tenant", "default") as (
            server,
            client,
        ):
            _, first_s, first_bodies, _ = run(client, input_path)
            second, second_s, second_bodies, replayed = run(client, input_path)
            rss = peak_rss_mib(server.pid)
        cache_bytes = (root / "cached" / "result_cache.sqlite3").stat().st_size
    assert replayed == args.requests, f"only {replayed} of {args.requests} lines came from the cache"
    expected = {custom_id: as_replayed(body) for custom_id, body in first_bodies.items()}
    assert second_bodies == expected, "the second run's bodies differ from the first's"
    usage = second["usage"]
    assert isinstance(usage, dict)
    figures = {
        "requests": args.requests,
        "latency_s": args.latency_s,
        "baseline_no_cache_req_per_s": round(args.requests / baseline_s, 1),
        "first_run_req_per_s": round(args.requests / first_s, 1),
        "second_run_from_cache_req_per_s": round(args.requests / second_s, 1),
        "second_over_first": round(first_s / second_s, 2),
        "first_over_baseline": round(baseline_s / first_s, 3),
        "cached_requests": usage["cached_requests"],
        "saved_tokens": usage["saved_tokens"],
        "cache_file_mib": round(cache_bytes / 2**20, 1),
        "server_peak_rss_mib": round(rss, 1),
        "bodies_identical": True,
    }
    print(f"{args.requests:,} greedy chat requests, simulated latency {args.latency_s} s")
    print(f"  no cache (baseline):   {figures['baseline_no_cache_req_per_s']:>10,.1f} req/s")
    print(
        f"  first run, cache on:   {figures['first_run_req_per_s']:>10,.1f} req/s "
        f"({figures['first_over_baseline']}x the baseline)"
    )
    print(
        f"  second run, cached:    {figures['second_run_from_cache_req_per_s']:>10,.1f} req/s "
        f"({figures['second_over_first']}x the first run), bodies the first run's"
    )
    print(
        f"  cache file {figures['cache_file_mib']} MiB, server peak RSS {figures['server_peak_rss_mib']} MiB"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
