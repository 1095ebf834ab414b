"""What ``output_order: "input"`` adds: the same batch unordered (baseline) and ordered, one run.

Runs N chat requests through the simulated backend (zero latency, plus a per-token latency with
each line asking for a different ``max_tokens``, so requests finish out of input order) embedded
(BatchService in this process), twice over the same input: once with ``output_order``
"completion", once with "input". The time the ordering adds is the span from the last line
written (``finalizing``) to ``completed``, ordered minus baseline; the end-to-end times are printed
too, but on a shared machine their difference is mostly run-to-run noise. Then it times the
rewrite alone on a fully shuffled result file of the same size (the worst case: no neighbouring
lines to copy together), and measures that rewrite's peak Python memory with ``tracemalloc`` in a
second pass (tracing slows it, so it is not timed). Prints the figures, then one JSON object with
them as the last line.

    python benchmarks/output_order.py [--requests 1000000]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import anyio
from chat_inputs import write_chat_input

from batchgen.core import BatchService, ServiceSettings, load_backend
from batchgen.core.batches.output_order import rewrite_in_input_order


async def run_batch(input_path: Path, storage: Path, order: str, count: int) -> tuple[float, float, Path]:
    """Seconds from create to ``completed``, seconds from ``finalizing`` (every line written) to
    ``completed`` (the ordered rewrite, for "input"), and the output file."""
    settings = ServiceSettings(storage_path=storage)
    backend = load_backend("simulated", token_latency_s=0.0001)
    async with BatchService(settings, backend) as service:
        file = await service.create_file(input_path)
        start = time.perf_counter()
        batch = await service.create_batch(file.id, "/v1/chat/completions", output_order=order)
        finalizing: float | None = None
        while not batch.status.is_terminal:
            await anyio.sleep(0.005)
            batch = await service.get_batch(batch.id)
            if finalizing is None and batch.status.value in ("finalizing", "completed"):
                finalizing = time.perf_counter()
        done = time.perf_counter()
        assert batch.status.value == "completed" and batch.request_counts.completed == count, batch
        assert batch.output_order == order and finalizing is not None
        return done - start, done - finalizing, storage / "incremental" / f"{batch.id}.jsonl"


def shuffled_copy(source: Path, target: Path, seed: int = 22) -> None:
    lines = source.read_bytes().splitlines(keepends=True)  # the benchmark may hold it; the server never does
    random.Random(seed).shuffle(lines)
    target.write_bytes(b"".join(lines))


def in_input_order(input_path: Path, output: Path) -> bool:
    with input_path.open("rb") as requests, output.open("rb") as results:
        for request, result in zip(requests, results, strict=True):
            if json.loads(request)["custom_id"] != json.loads(result)["custom_id"]:
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    count = parser.parse_args().requests
    with tempfile.TemporaryDirectory(prefix="bg-order-") as folder:
        root = Path(folder)
        input_path = root / "input.jsonl"
        write_chat_input(input_path, count, lambda i: {"max_tokens": 1 + (i * 7919) % 16})
        baseline_s, baseline_end_s, appended = anyio.run(
            run_batch, input_path, root / "completion", "completion", count
        )
        ordered_s, ordered_end_s, ordered = anyio.run(run_batch, input_path, root / "input", "input", count)
        assert in_input_order(input_path, ordered), "the ordered batch's output is not in input order"
        output_mb = ordered.stat().st_size / 1e6
        appended_in_order = in_input_order(input_path, appended)

        shuffled = root / "shuffled.jsonl"
        shuffled_copy(appended, shuffled)
        backup = root / "shuffled.backup.jsonl"
        shutil.copyfile(shuffled, backup)
        start = time.perf_counter()
        rewrite_in_input_order(input_path, shuffled)
        rewrite_s = time.perf_counter() - start
        shutil.copyfile(backup, shuffled)
        tracemalloc.start()
        rewrite_in_input_order(input_path, shuffled)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()

    figures = {
        "requests": count,
        "output_mb": round(output_mb, 1),
        "baseline_completion_order_s": round(baseline_s, 2),
        "input_order_s": round(ordered_s, 2),
        "end_to_end_difference_s": round(ordered_s - baseline_s, 2),
        "baseline_last_line_to_completed_s": round(baseline_end_s, 3),
        "input_order_last_line_to_completed_s": round(ordered_end_s, 3),
        "ordering_adds_s": round(ordered_end_s - baseline_end_s, 2),
        "ordering_adds_fraction_of_baseline_run": round((ordered_end_s - baseline_end_s) / baseline_s, 3),
        "baseline_output_was_in_input_order": appended_in_order,
        "rewrite_alone_shuffled_s": round(rewrite_s, 2),
        "rewrite_peak_traced_mib": round(peak / 2**20, 1),
        "rewrite_peak_bytes_per_line": round(peak / count, 1),
    }
    print(f"{count} requests, output {figures['output_mb']} MB")
    print(
        f"completion order (baseline): {baseline_s:8.2f} s create to completed, "
        f"{baseline_end_s:.3f} s from the last line to completed"
    )
    print(
        f"input order:                 {ordered_s:8.2f} s create to completed, "
        f"{ordered_end_s:.3f} s from the last line to completed (the rewrite)"
    )
    print(
        f"the ordering adds {figures['ordering_adds_s']} s "
        f"({100 * figures['ordering_adds_fraction_of_baseline_run']:.1f}% of the baseline run); "
        f"end to end the runs differ by {figures['end_to_end_difference_s']} s (run-to-run noise included)"
    )
    print(f"rewrite alone, fully shuffled file: {figures['rewrite_alone_shuffled_s']} s")
    print(
        f"rewrite peak traced memory: {figures['rewrite_peak_traced_mib']} MiB "
        f"({figures['rewrite_peak_bytes_per_line']} bytes/line)"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
