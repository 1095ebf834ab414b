"""Model throughput: the same chat requests through the running service and through plain generate.

Starts ``batchgen-server`` (transformers backend with its defaults: continuous batching of up to
64 requests, ``--dtype auto``; SmolLM2-135M-Instruct by default) on 127.0.0.1, runs N greedy chat
requests as one batch, and in the same run generates the same prompts with plain
``model.generate`` two ways, as a hand-written script would:

- float32, left-padded batches of 16 (the earlier baseline);
- the best plain setup: the dtype ``--dtype auto`` picks on this machine (bfloat16 where the CPU
  has native bfloat16, float32 otherwise) and all N prompts in one left-padded batch.

All count the tokens each request generated (up to and including its end-of-sequence token) over
the wall time of the generation. Prints the rates and the ratios service / plain, then one JSON
line. ``--service-flag`` passes more flags to the server (``--service-flag=--dtype=float32``).
It then runs the embeddings figure of ``embedding_throughput.py`` (``--embedding-lines`` texts
through the service's all-MiniLM-L6-v2 against the same model called directly; 0 skips it), whose
figures are the JSON line's ``embeddings`` entry.

    python benchmarks/model_throughput.py [--requests 64] [--max-tokens 64] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import embedding_throughput
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


def plain_generate(
    folder: Path, count: int, max_tokens: int, batch_size: int, dtype: str = "float32"
) -> tuple[int, float]:
    """Tokens generated and seconds taken by padded ``model.generate`` batches in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
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


def chat_batch(count: int, max_tokens: int, tag: str = "q") -> bytes:
    """A batch input file of ``count`` chat requests (``messages(i)``, custom ids ``{tag}{i}``)."""
    lines = [
        {
            "custom_id": f"{tag}{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": messages(i), "max_tokens": max_tokens},
        }
        for i in range(count)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def service_run(
    storage: Path, model: str | None, count: int, max_tokens: int, extra_flags: list[str]
) -> tuple[int, float]:
    """Tokens generated and seconds from batch creation to completion, through batchgen-server."""
    flags = ["--backend", "transformers", *extra_flags]
    if model:
        flags += ["--model", model]
    content = chat_batch(count, max_tokens)
    with running_server(storage, 10991, *flags) as (_, client):
        run_batch(client, content[: content.index(b"\n") + 1])  # warm-up: one request
        batch, _, run_s = run_batch(client, content)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == count, batch
    return batch["usage"]["output_tokens"], run_s


def main() -> None:
    from batchgen.core.backends.hf_dtype import resolve_dtype

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="the float32 plain baseline's batch size")
    parser.add_argument(
        "--service-flag", action="append", default=[], help="one more batchgen-server flag (repeatable)"
    )
    parser.add_argument(
        "--model", default=None, help="a Hugging Face folder or GGUF (default: packaged SmolLM2)"
    )
    parser.add_argument(
        "--embedding-lines", type=int, default=512, help="texts for the embeddings figure (0: skip it)"
    )
    parser.add_argument(
        "--storage-path",
        default=None,
        help="server storage (holds the converted model cache); default: a temp dir",
    )
    args = parser.parse_args()
    best_dtype = resolve_dtype("auto", "cpu")
    with tempfile.TemporaryDirectory() as scratch:
        storage = Path(args.storage_path or scratch)
        folder, name = resolve_model_folder(args.model, storage / "models")
        service_tokens, service_s = service_run(
            storage, args.model, args.requests, args.max_tokens, args.service_flag
        )
        plain_tokens, plain_s = plain_generate(folder, args.requests, args.max_tokens, args.batch_size)
        best_tokens, best_s = plain_generate(
            folder, args.requests, args.max_tokens, args.requests, dtype=best_dtype
        )
        embeddings = (
            embedding_throughput.measure(storage, args.embedding_lines, 1, 64)
            if args.embedding_lines
            else None
        )
    service_rate = service_tokens / service_s
    figures = {
        "model": name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "service_flags": args.service_flag,
        "service_tokens": service_tokens,
        "service_s": round(service_s, 2),
        "service_tokens_per_s": round(service_rate, 1),
        "plain_batch_size": args.batch_size,
        "plain_tokens": plain_tokens,
        "plain_s": round(plain_s, 2),
        "plain_tokens_per_s": round(plain_tokens / plain_s, 1),
        "ratio": round(service_rate / (plain_tokens / plain_s), 3),
        "best_plain_dtype": best_dtype,
        "best_plain_batch_size": args.requests,
        "best_plain_tokens": best_tokens,
        "best_plain_s": round(best_s, 2),
        "best_plain_tokens_per_s": round(best_tokens / best_s, 1),
        "ratio_to_best_plain": round(service_rate / (best_tokens / best_s), 3),
        "embeddings": embeddings,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(
        f"service (batchgen-server, transformers): {figures['service_tokens_per_s']} tok/s ({service_tokens} tokens)"
    )
    print(
        f"plain model.generate, float32, batches of {args.batch_size}: "
        f"{figures['plain_tokens_per_s']} tok/s ({plain_tokens} tokens)"
    )
    print(
        f"plain model.generate, {best_dtype}, one batch of {args.requests}: "
        f"{figures['best_plain_tokens_per_s']} tok/s ({best_tokens} tokens)"
    )
    print(f"ratio service / plain float32 batches of {args.batch_size}: {figures['ratio']}")
    print(f"ratio service / best plain: {figures['ratio_to_best_plain']}")
    if embeddings is not None:
        embedding_throughput.report(embeddings)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
