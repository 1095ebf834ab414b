"""Prefix-aware dispatch on vLLM's prefix cache: lines of one prompt prefix admitted together, or
in file order, side by side in one run.

Two workloads through ``batchgen-server --backend vllm`` (SmolLM2, prefix caching on):

``shared``     P prefixes (a system prompt of about ``--prefix-words`` words and a few examples)
               with R items each, the lines shuffled, and a KV cache (``--kv-cache-gib``) far too
               small to hold every prefix at once: in file order the engine evicts a prefix before
               its next line comes, grouped it computes each prefix about once
``distinct``   the same number of lines, no two sharing a start (grouping must cost nothing)

Each runs with ``--prefix-grouping on`` and ``off`` (a fresh server each time, engine start not
timed, nor a small warm-up batch of prompts unrelated to either workload that each fresh server
runs first; from the batch's create to its end), ``--rounds`` times, the two settings' order
alternating between rounds; the figures are medians. Prints
requests/s and tokens/s (prompt and completion) per setting, the ratios on/off (targets: >= 1.3
on shared, >= 0.98 on distinct), the prompt tokens the cache served, which CPU, and one JSON line.

    .nox/vllm/bin/python benchmarks/prefix_dispatch.py [--prefixes 100] [--per-prefix 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from running_server import free_port, run_batch, running_server
from vllm_overhead import cpu_name

WORDS = ("river", "stone", "cloud", "amber", "forest", "signal", "harbor", "lantern", "meadow", "copper")


def system_prompt(prefix: int, words: int) -> str:
    rng = random.Random(prefix)
    body = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words))
    return f"You are classifier number {prefix}. Rules: {body}. Answer with one word."


def chat_line(custom_id: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def lines(workload: str, prefixes: int, per_prefix: int, words: int, max_tokens: int) -> list[dict[str, Any]]:
    found = []
    for prefix in range(prefixes):
        for item in range(per_prefix):
            if workload == "shared":
                system = system_prompt(prefix, words)
            else:  # every line its own start, about as long
                system = system_prompt(prefixes * per_prefix + prefix * per_prefix + item, words)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Item {item}: is {WORDS[item % len(WORDS)]} a thing?"},
            ]
            found.append(chat_line(f"p{prefix}-i{item}", messages, max_tokens))
    random.Random(7).shuffle(found)
    return found


def warm_up_lines(count: int, words: int, max_tokens: int) -> bytes:
    """Lines whose prompts share no start with either workload's (their numbers are out of range),
    to run the engine's first passes before the timed batch without filling its cache with it."""
    return _jsonl(
        [
            chat_line(
                f"warm-{index}",
                [{"role": "system", "content": system_prompt(10**9 + index, words)}],
                max_tokens,
            )
            for index in range(count)
        ]
    )


def _jsonl(batch: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in batch)


def run(
    batch: list[dict[str, Any]],
    warm_up: bytes,
    grouping: str,
    kv_cache_gib: float,
    scratch: Path,
) -> dict[str, Any]:
    flags = ("--backend", "vllm", "--kv-cache-gib", str(kv_cache_gib), "--max-context-length", "2048")
    flags = (*flags, "--prefix-grouping", grouping)
    with running_server(scratch / grouping, free_port(), *flags) as (_, client):
        # a fresh engine's first passes are slow on a CPU (its kernels meet each shape for the first
        # time): a small untimed batch first, so the timed one measures the dispatch, not the warm-up
        if warm_up:
            run_batch(client, warm_up)
        done, _, elapsed = run_batch(client, _jsonl(batch))
    if done["status"] != "completed" or done["request_counts"]["completed"] != len(batch):
        raise RuntimeError(f"the batch ended {done['status']}: {done['request_counts']}")
    usage = done["usage"]
    return {
        "seconds": elapsed,
        "requests_per_s": len(batch) / elapsed,
        "tokens_per_s": (usage["input_tokens"] + usage["output_tokens"]) / elapsed,
        "prompt_tokens": usage["input_tokens"],
        "cached_prompt_tokens": usage["input_tokens_details"]["cached_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=100)
    parser.add_argument("--per-prefix", type=int, default=10)
    parser.add_argument("--prefix-words", type=int, default=150, help="about 2.5 tokens a word")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warm-up", type=int, default=32, help="untimed lines each fresh server runs before the timed batch"
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=("shared", "distinct"), default=["shared", "distinct"]
    )
    args = parser.parse_args()
    from batchgen.core.backends.hf_dtype import cpu_has_native_bf16

    results: dict[str, Any] = {
        "cpu": cpu_name(),
        "native_bf16": cpu_has_native_bf16(),
        "prefixes": args.prefixes,
        "per_prefix": args.per_prefix,
        "kv_cache_gib": args.kv_cache_gib,
        "rounds": args.rounds,
    }
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        for workload in args.workloads:
            batch = lines(workload, args.prefixes, args.per_prefix, args.prefix_words, args.max_tokens)
            runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            warm_up = warm_up_lines(args.warm_up, args.prefix_words, args.max_tokens)
            for round_number in range(args.rounds):
                # on first in even rounds, off first in odd ones: a drift of the machine's speed
                # over the run does not favour either setting
                order = ("on", "off") if round_number % 2 == 0 else ("off", "on")
                for grouping in order:
                    where = scratch / f"{workload}-{round_number}"
                    figures = run(batch, warm_up, grouping, args.kv_cache_gib, where)
                    runs[grouping].append(figures)
                    print(
                        f"{workload}, round {round_number + 1}, grouping {grouping}: {json.dumps(figures)}",
                        flush=True,
                    )
            medians = {
                grouping: {key: round(statistics.median(run[key] for run in done), 1) for key in done[0]}
                for grouping, done in runs.items()
            }
            ratio = round(medians["on"]["tokens_per_s"] / medians["off"]["tokens_per_s"], 3)
            results[workload] = {"medians": medians, "ratio_on_to_off": ratio}
            print(f"{workload}: medians {json.dumps(medians)}; grouped / file order = {ratio}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
