"""The merged view of a batch and its retries: time and memory to index and stream it.

A family is made on disk as the service would leave it: an input file of N chat lines, the first
batch's output (30% error lines, in a shuffled order, as requests finish), a first retry's output
over those failures (30% of them failing again) and a second retry's over what is left (all
succeeding). ``result_merge.FamilyIndex`` then indexes it and streams the merged view, which is
checked (one line per request, every one a success, input order). The floor, measured in the same
run, reads the same result files once, line by line, and decodes each line's ``custom_id`` with
the same codec: the least any merge must do. Peak RSS growth (``ru_maxrss``) is reported for both
(the family is made in a child process, so it does not count).

    python benchmarks/merged_results.py [--requests 1000000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from batchgen.core.batches.result_merge import FamilyIndex


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _result(custom_id: str, ok: bool, attempt: int) -> bytes:
    if ok:
        body = {"id": "chatcmpl-x", "object": "chat.completion", "choices": [{"index": 0, "message": {
            "role": "assistant", "content": f"answer to {custom_id} " * 8}, "finish_reason": "stop"}]}  # fmt: skip
        record = {"id": f"batch_req_{attempt}_{custom_id}", "custom_id": custom_id,
                  "response": {"status_code": 200, "request_id": "req", "body": body}, "error": None}  # fmt: skip
    else:
        record = {"id": f"batch_req_{attempt}_{custom_id}", "custom_id": custom_id, "response": None,
                  "error": {"code": "backend_error", "message": "simulated transient failure"}}  # fmt: skip
    return json.dumps(record).encode() + b"\n"


def make_family(folder: Path, requests: int, seed: int = 22) -> tuple[Path, list[Path]]:
    """The input file and the family's result files (first batch, then its retries), streamed to
    disk; returns their paths."""
    rng = random.Random(seed)
    input_path = folder / "input.jsonl"
    with open(input_path, "wb") as stream:
        for i in range(requests):
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": f"question {i}"}]}}  # fmt: skip
            stream.write(json.dumps(line).encode() + b"\n")
    pending = list(range(requests))
    outputs: list[Path] = []
    for attempt, failure_rate in enumerate((0.3, 0.3, 0.0)):
        rng.shuffle(pending)  # lines are written as requests finish, not in input order
        path = folder / f"output-{attempt}.jsonl"
        failed: list[int] = []
        with open(path, "wb") as stream:
            for i in pending:
                ok = rng.random() >= failure_rate
                stream.write(_result(f"r{i}", ok, attempt))
                if not ok:
                    failed.append(i)
        outputs.append(path)
        pending = failed
    return input_path, outputs


class _Id(msgspec.Struct):
    custom_id: str


def floor(outputs: list[Path]) -> tuple[float, int]:
    """Read every result line once and decode its custom_id: seconds and lines."""
    decode = msgspec.json.Decoder(_Id).decode
    started = time.perf_counter()
    count = 0
    for path in outputs:
        with open(path, "rb") as stream:
            for raw in stream:
                decode(raw)
                count += 1
    return time.perf_counter() - started, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--requests", type=int, default=1_000_000, help="requests in the batch (default 1,000,000)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        made = time.perf_counter()
        # made in a child process, so that this one's peak RSS is only what the merge takes
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            input_path, outputs = pool.apply(make_family, (root, args.requests))
        result_bytes = sum(path.stat().st_size for path in outputs)
        print(f"family of {args.requests:,} requests: {len(outputs)} result files, {result_bytes / 1e6:.0f} MB "
              f"(made in {time.perf_counter() - made:.1f} s)")  # fmt: skip
        rss_before = _peak_rss_mib()
        floor_s, lines = floor(outputs)
        rss_floor = _peak_rss_mib()
        print(
            f"floor (read and decode {lines:,} result lines): {floor_s:.2f} s, peak RSS +{rss_floor - rss_before:.1f} MiB"
        )
        started = time.perf_counter()
        with FamilyIndex.build(root / "index.sqlite3", input_path, outputs) as index:
            indexed_s = time.perf_counter() - started
            streamed = 0
            seen = 0
            expected = 0
            for chunk in index.merged_chunks():
                streamed += len(chunk)
                for raw in chunk.splitlines():
                    record = msgspec.json.decode(raw)
                    assert record["custom_id"] == f"r{expected}" and record["error"] is None, record
                    expected += 1
                seen += chunk.count(b"\n")
            total_s = time.perf_counter() - started
        rss_merge = _peak_rss_mib()
        assert seen == expected == args.requests, (seen, expected)
        print(f"merged view: index {indexed_s:.2f} s, index + stream {total_s:.2f} s "
              f"({args.requests / total_s:,.0f} requests/s, {streamed / 1e6:.0f} MB streamed, checked), "
              f"{total_s / floor_s:.1f}x the floor; peak RSS +{rss_merge - rss_floor:.1f} MiB")  # fmt: skip
        figures = {
            "requests": args.requests,
            "result_mb": round(result_bytes / 1e6, 1),
            "floor_s": round(floor_s, 3),
            "index_s": round(indexed_s, 3),
            "index_and_stream_s": round(total_s, 3),
            "ratio_to_floor": round(total_s / floor_s, 2),
            "peak_rss_growth_floor_mib": round(rss_floor - rss_before, 1),
            "peak_rss_growth_merge_mib": round(rss_merge - rss_floor, 1),
        }
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
