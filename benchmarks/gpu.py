"""GPU throughput: a backend through the service vs its engine used directly.

For a machine with an NVIDIA GPU. Builds a model of a real shape with random weights (TinyLlama
1.1B by default, bf16) and a small byte-level tokenizer trained on the spot, so nothing is
downloaded and no weights are needed. Runs N requests of about 128 prompt tokens and exactly
``--new-tokens`` output tokens (the model has no end-of-sequence token) end to end through an
embedded BatchService, and in the same run through plain ``model.generate`` in batches of the same
size. Prints both token rates and ratio = service / plain, then one JSON line.

``--engine vllm`` measures the vllm backend instead (an environment with the CUDA ``vllm``
package): the same requests through an embedded BatchService on ``VLLMBackend``, and through
vLLM's offline ``LLM.generate`` on all prompts at once (the issue's target: >= 0.95).

    python benchmarks/gpu.py [--shape tinyllama-1.1b] [--requests 1024] [--batch-size 256]
    python benchmarks/gpu.py --engine vllm --requests 1024
    python benchmarks/gpu.py --device cpu --shape tiny --requests 32 --batch-size 16 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.hf_transformers import TransformersBackend

SHAPES: dict[str, dict[str, int]] = {
    "tinyllama-1.1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
    },
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def prompt_text(i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "number"]
    return " ".join(f"{words[(i + k) % len(words)]}{k}" for k in range(60))


def build_model(folder: Path, shape: str, device: str) -> None:
    """Save a random-weight model of ``shape`` and a freshly trained byte-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<pad>"])
    tokenizer.train_from_iterator([prompt_text(i) for i in range(200)], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>")
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(folder)

    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=4096,
        pad_token_id=wrapped.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)


def plain_generate(
    folder: Path, device: str, count: int, batch_size: int, new_tokens: int
) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model = model.to(device).eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt_text(i)}], tokenize=False, add_generation_prompt=True
        )
        for i in range(count)
    ]
    tokens = 0
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, count, batch_size):
        encoded = tokenizer(prompts[first : first + batch_size], return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            output = model.generate(
                **encoded,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens += (output.shape[1] - encoded["input_ids"].shape[1]) * output.shape[0]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


async def service_run(
    folder: Path, device: str, count: int, batch_size: int, new_tokens: int
) -> tuple[int, float]:
    backend = TransformersBackend(
        model=str(folder), cache_dir=folder.parent, device=device, max_batch_size=batch_size
    )
    settings = ServiceSettings(storage_path=folder.parent / "storage", max_pool_size=max(batch_size * 2, 64))
    return await _through_service(backend, settings, count, new_tokens)


async def _through_service(
    backend: Any, settings: ServiceSettings, count: int, new_tokens: int
) -> tuple[int, float]:
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": prompt_text(i)}], "max_tokens": new_tokens},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )
    async with BatchService(settings, backend) as service:
        file = await service.create_file(lines)
        start = time.perf_counter()
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        batch = await service.wait_for_batch(batch.id, poll_interval=0.01)
        elapsed = time.perf_counter() - start
    assert batch.request_counts.completed == count, batch.request_counts
    return batch.usage.completion_tokens, elapsed


def plain_vllm(folder: Path, count: int, new_tokens: int) -> tuple[int, float]:
    """vLLM's offline engine on all the prompts at once (the model has no end token)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="bfloat16", max_model_len=2048)
    conversations = [[{"role": "user", "content": prompt_text(i)}] for i in range(count)]
    start = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(max_tokens=new_tokens, temperature=0), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(output.outputs[0].token_ids) for output in outputs), elapsed


async def service_vllm(folder: Path, count: int, new_tokens: int) -> tuple[int, float]:
    from batchgen.core.backends.vllm_engine import VLLMBackend

    backend = VLLMBackend(model=str(folder), dtype="bfloat16", context_length=2048)
    settings = ServiceSettings(storage_path=folder.parent / "storage-vllm", max_pool_size=max(count, 64))
    return await _through_service(backend, settings, count, new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        build_model(folder, args.shape, args.device)
        if args.engine == "vllm":
            service_tokens, service_s = anyio.run(service_vllm, folder, args.requests, args.new_tokens)
            plain_tokens, plain_s = plain_vllm(folder, args.requests, args.new_tokens)
        else:
            service_tokens, service_s = anyio.run(
                service_run, folder, args.device, args.requests, args.batch_size, args.new_tokens
            )
            plain_tokens, plain_s = plain_generate(
                folder, args.device, args.requests, args.batch_size, args.new_tokens
            )
    figures = {
        "engine": args.engine,
        "shape": args.shape,
        "device": args.device,
        "requests": args.requests,
        "batch_size": args.batch_size,
        "new_tokens": args.new_tokens,
        "service_tokens_per_s": round(service_tokens / service_s, 1),
        "plain_tokens_per_s": round(plain_tokens / plain_s, 1),
        "ratio": round((service_tokens / service_s) / (plain_tokens / plain_s), 3),
    }
    plain = (
        "vLLM's offline LLM.chat, all at once"
        if args.engine == "vllm"
        else f"plain model.generate, batches of {args.batch_size}"
    )
    print(f"service (embedded BatchService, {args.engine} backend): {figures['service_tokens_per_s']} tok/s")
    print(f"{plain}: {figures['plain_tokens_per_s']} tok/s")
    print(f"ratio service / plain: {figures['ratio']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
