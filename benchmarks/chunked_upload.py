"""Uploads API throughput: a multi-gigabyte batch input through ``client.uploads.upload_file_chunked``.

Writes an input of N chat lines of about 500 bytes each (default 8,000,000 lines, 4 GB) into a
temporary folder, starts a ``batchgen-server`` subprocess (simulated backend), and uploads the
file with the unchanged ``openai`` SDK's ``upload_file_chunked`` (64 MiB parts, sent one after
another; ``complete`` validates and assembles). It reports, end to end, upload + validation MB/s;
the server's RSS growth (peak ``VmHWM`` during the upload minus its RSS once healthy) and the peak
RSS of its validation worker process (``upload_validation_worker``); and the peak disk the upload
took under the storage folder (sampled every 20 ms) against the file's size. The baseline, in the
same run: one single-shot ``POST /v1/files`` of the first 400 MB of the same lines (under the
512 MiB limit of that route). Prints the figures, then one JSON object with them as the last line.

    python benchmarks/chunked_upload.py [--lines 8000000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import openai
from running_server import peak_rss_mib, running_server, upload

LINE_BYTES = 500
BASELINE_BYTES = 400_000_000


def write_input(path: Path, count: int) -> None:
    """``count`` chat lines of ``LINE_BYTES`` bytes each (newline included)."""
    with path.open("w") as stream:
        for i in range(count):
            head = (
                f'{{"custom_id": "request-{i}", "method": "POST", "url": "/v1/chat/completions", '
                f'"body": {{"model": "default", "messages": [{{"role": "user", "content": "Question {i}: '
            )
            tail = '"}]}}\n'
            stream.write(head + "x" * (LINE_BYTES - len(head) - len(tail)) + tail)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found += [int(child) for child in listing.read().split()]
        except OSError:
            pass
    return found


class DiskSampler:
    """The most bytes the files under ``root`` held at once, and the peak RSS of the server's child
    processes (the upload's validation worker), sampled in a thread."""

    def __init__(self, root: Path, server_pid: int) -> None:
        self.root = root
        self.server_pid = server_pid
        self.peak = 0
        self.children_peak_mib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int:
        total = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(folder, name)).st_blocks * 512
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            for child in children(self.server_pid):
                with contextlib.suppress(OSError, StopIteration):
                    self.children_peak_mib[child] = peak_rss_mib(child)
            time.sleep(0.02)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=8_000_000)
    parser.add_argument("--port", type=int, default=10931)
    args = parser.parse_args()
    size = args.lines * LINE_BYTES
    root = Path(tempfile.mkdtemp(prefix="chunked-upload-"))
    free = shutil.disk_usage(root).free
    if free < 2.5 * size + BASELINE_BYTES:
        raise SystemExit(f"{root} has {free / 1e9:.1f} GB free; this run needs {2.5 * size / 1e9:.1f} GB")
    try:
        input_path = root / "input.jsonl"
        write_input(input_path, args.lines)
        baseline_path = root / "baseline.jsonl"
        with input_path.open("rb") as source, baseline_path.open("wb") as sink:
            sink.write(source.read(min(BASELINE_BYTES, size)))
        os.sync()  # the input's own writeback to disk is not the upload's cost
        storage = root / "storage"
        with running_server(storage, args.port, "--backend", "simulated") as (server, client):
            start_rss = rss_mib(server.pid)
            sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused", timeout=3600)
            with DiskSampler(storage, server.pid) as disk:
                started = time.perf_counter()
                done = sdk.uploads.upload_file_chunked(
                    file=input_path, mime_type="text/jsonl", purpose="batch"
                )
                seconds = time.perf_counter() - started
            peak_rss = peak_rss_mib(server.pid)
            assert done.status == "completed" and done.file is not None and done.file.bytes == size
            stored = (storage / "files" / f"{done.file.id}.jsonl").stat().st_size
            client.delete(f"/v1/files/{done.file.id}").raise_for_status()
            baseline_s = upload(client, baseline_path)[1]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {
        "lines": args.lines,
        "bytes": size,
        "upload_validate_mb_per_s": round(size / 1e6 / seconds, 1),
        "upload_validate_s": round(seconds, 1),
        "baseline_single_post_mb_per_s": round(min(BASELINE_BYTES, size) / 1e6 / baseline_s, 1),
        "server_rss_growth_mib": round(peak_rss - start_rss, 1),
        "validation_worker_peak_rss_mib": round(max(disk.children_peak_mib.values(), default=0.0), 1),
        "peak_disk_bytes": disk.peak,
        "peak_disk_over_file": round(disk.peak / stored, 3),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(
        f"{args.lines} lines, {size / 1e9:.2f} GB through upload_file_chunked: "
        f"{figures['upload_validate_mb_per_s']} MB/s upload + validation ({figures['upload_validate_s']} s); "
        f"baseline single POST /v1/files of {min(BASELINE_BYTES, size) / 1e6:.0f} MB: "
        f"{figures['baseline_single_post_mb_per_s']} MB/s; server RSS growth {figures['server_rss_growth_mib']} MiB "
        f"(its validation worker's peak RSS: {figures['validation_worker_peak_rss_mib']} MiB); "
        f"peak disk {disk.peak / 1e9:.2f} GB = {figures['peak_disk_over_file']} x the file"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
