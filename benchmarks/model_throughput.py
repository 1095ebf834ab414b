"""Model throughput: the same chat requests through the running service and through plain generate.

Starts ``batchgen-server`` (transformers backend, SmolLM2-135M-Instruct by default) on 127.0.0.1,
runs N greedy chat requests as one batch, and in the same run generates the same prompts with plain
``model.generate`` in left-padded batches of 16, the way a hand-written script would. Both count
the tokens each request generated (up to and including its end-of-sequence token) over the wall
time of the generation. Prints both rates and ratio = service / plain, then one JSON line.

    python benchmarks/model_throughput.py [--requests 64] [--max-tokens 64] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from running_server import run_batch, running_server

from batchgen.core.backends.hf_model_files import resolve_model_folder

QUESTIONS = [
    "What is 2+2?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
    "What is a prime number?",
]


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (question {i})"}]


def plain_generate(folder: Path, count: int, max_tokens: int, batch_size: int) -> tuple[int, float]:
    """Tokens generated and seconds taken by padded ``model.generate`` batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    prompts = [
        tokenizer.apply_chat_template(messages(i), tokenize=False, add_generation_prompt=True)
        for i in range(count)
    ]
    tokens = 0
    start = time.perf_counter()
    for first in range(0, count, batch_size):
        encoded = tokenizer(
            prompts[first : first + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
        )
        with torch.inference_mode():
            output = model.generate(
                **encoded, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        for row in output[:, encoded["input_ids"].shape[1] :].tolist():
            ends = [i for i, token in enumerate(row) if token in eos_ids]
            tokens += ends[0] + 1 if ends else len(row)
    return tokens, time.perf_counter() - start


def service_run(
    storage: Path, model: str | None, count: int, max_tokens: int, batch_size: int
) -> tuple[int, float]:
    """Tokens generated and seconds from batch creation to completion, through batchgen-server."""
    flags = ["--backend", "transformers", "--max-batch-size", str(batch_size)]
    if model:
        flags += ["--model", model]
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": messages(i), "max_tokens": max_tokens},
        }
        for i in range(count)
    ]
    with running_server(storage, 10991, *flags) as (_, client):
        batch, _, run_s = run_batch(client, "".join(json.dumps(line) + "\n" for line in lines).encode())
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == count, batch
    return batch["usage"]["output_tokens"], run_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--batch-size", type=int, default=16, help="plain generate's batch size, and the service's"
    )
    parser.add_argument(
        "--model", default=None, help="a Hugging Face folder or GGUF (default: packaged SmolLM2)"
    )
    parser.add_argument(
        "--storage-path",
        default=None,
        help="server storage (holds the converted model cache); default: a temp dir",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        storage = Path(args.storage_path or scratch)
        folder, name = resolve_model_folder(args.model, storage / "models")
        service_tokens, service_s = service_run(
            storage, args.model, args.requests, args.max_tokens, args.batch_size
        )
        plain_tokens, plain_s = plain_generate(folder, args.requests, args.max_tokens, args.batch_size)
    figures = {
        "model": name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "service_tokens": service_tokens,
        "service_s": round(service_s, 2),
        "service_tokens_per_s": round(service_tokens / service_s, 1),
        "plain_tokens": plain_tokens,
        "plain_s": round(plain_s, 2),
        "plain_tokens_per_s": round(plain_tokens / plain_s, 1),
        "ratio": round((service_tokens / service_s) / (plain_tokens / plain_s), 3),
        "cpus": os.cpu_count(),
    }
    print(
        f"service (batchgen-server, transformers): {figures['service_tokens_per_s']} tok/s ({service_tokens} tokens)"
    )
    print(
        f"plain model.generate, batches of {args.batch_size}:   {figures['plain_tokens_per_s']} tok/s ({plain_tokens} tokens)"
    )
    print(f"ratio service / plain: {figures['ratio']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
