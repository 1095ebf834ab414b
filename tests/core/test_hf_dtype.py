"""``--dtype auto`` follows the hardware: bfloat16 on CUDA and on CPUs with native bfloat16, else float32."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.core.backends.hf_dtype import DTYPE_CHOICES, cpu_flags, cpu_has_native_bf16, resolve_dtype

EPYC = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
OLDER_CPU = frozenset({"fpu", "sse4_2", "avx2", "avx512f"})


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [
        (EPYC, "cpu", "bfloat16"),
        (SAPPHIRE_RAPIDS, "cpu", "bfloat16"),
        (OLDER_CPU, "cpu", "float32"),
        (frozenset(), "cpu", "float32"),
        (OLDER_CPU, "cuda", "bfloat16"),
        (OLDER_CPU, "cuda:1", "bfloat16"),
    ],
)
def test_auto_follows_the_hardware(flags: frozenset[str], device: str, expected: str) -> None:
    assert resolve_dtype("auto", device, flags=flags) == expected


@pytest.mark.parametrize("choice", [choice for choice in DTYPE_CHOICES if choice != "auto"])
def test_a_chosen_dtype_is_kept(choice: str) -> None:
    assert resolve_dtype(choice, "cpu", flags=OLDER_CPU) == choice
    assert resolve_dtype(choice, "cuda", flags=EPYC) == choice


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        resolve_dtype("float8", "cpu")


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_has_native_bf16(cpu_flags(cpuinfo))
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert not cpu_has_native_bf16(frozenset())
