"""Which floating-point type the transformers backend computes in: ``--dtype`` and its ``auto`` choice.

``auto`` picks what the hardware runs fastest without a quality cliff:

- CUDA: ``bfloat16``;
- a CPU with native bfloat16 instructions (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``,
  e.g. AMD EPYC Zen 4 and later, Intel Cooper Lake / Sapphire Rapids and later): ``bfloat16``,
  about 2.6x the tokens/s of float32 for SmolLM2 on two EPYC cores;
- any other CPU: ``float32`` (bfloat16 is emulated there, and slower than float32).

Nothing here imports torch: the names are plain strings until the worker loads the model.
"""

from __future__ import annotations

from pathlib import Path

from batchgen.core.backends.spec import BackendOption

#: What ``--dtype`` accepts.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
#: CPU flags (``/proc/cpuinfo``) that mean bfloat16 matrix work runs natively.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def dtype_choice(text: str) -> str:
    """``--dtype`` as the command line gives it: one of ``DTYPE_CHOICES``."""
    if text not in DTYPE_CHOICES:
        raise ValueError(f"must be one of {', '.join(DTYPE_CHOICES)}, got {text!r}")
    return text


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags of the first CPU listed in ``cpuinfo`` (empty where the file does not exist)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, separator, value = line.partition(":")
        if separator and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (see ``NATIVE_BF16_FLAGS``)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def resolve_dtype(choice: str, device: str, *, flags: frozenset[str] | None = None) -> str:
    """The dtype name to load the model in, for ``--dtype choice`` on ``device``."""
    if choice not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16(flags) else "float32"


#: ``--dtype``, as every backend that loads a Hugging Face model declares it (one shared flag).
DTYPE_OPTION = BackendOption(
    "dtype",
    "--dtype",
    dtype_choice,
    "auto",
    "the floating-point type the model computes in; auto is bfloat16 on CUDA and on CPUs "
    "with native bfloat16 (avx512_bf16 or amx_bf16 flags), else float32",
    choices=DTYPE_CHOICES,
)
