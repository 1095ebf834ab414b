"""The engine arguments the vLLM backend builds from its options (``VLLMBackend.engine_kwargs``)
and the bounds of those options where they are parsed, without vLLM: the KV cache a CPU gets
when nothing sizes it, and the ``--kv-cache-gib`` values refused.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends.spec import BackendOption
from batchgen.core.backends.vllm_engine import (
    CPU_KV_CACHE_GIB,
    MAX_KV_CACHE_GIB,
    MIN_KV_CACHE_GIB,
    SPEC,
    VLLMBackend,
)

GIB = 2**30


def _kv_cache_option() -> BackendOption:
    [option] = [option for option in SPEC.options if option.flag == "--kv-cache-gib"]
    return option


def test_a_cpu_engine_gets_a_bounded_kv_cache_unless_something_sizes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    unsized = VLLMBackend(model="folder")
    # left to itself, vLLM's CPU worker would take 90% of the machine's memory
    assert unsized.engine_kwargs("folder", "cpu")["kv_cache_memory_bytes"] == int(CPU_KV_CACHE_GIB * GIB)
    assert "kv_cache_memory_bytes" not in unsized.engine_kwargs("folder", "cuda")  # vLLM's share of the GPU
    sized = VLLMBackend(model="folder", kv_cache_gib=0.5)
    for device in ("cpu", "cuda"):
        assert sized.engine_kwargs("folder", device)["kv_cache_memory_bytes"] == GIB // 2
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own variable, which it reads itself
    assert "kv_cache_memory_bytes" not in unsized.engine_kwargs("folder", "cpu")


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_kv_cache_gib_is_taken_only_within_its_bounds(value: float) -> None:
    option = _kv_cache_option()
    if MIN_KV_CACHE_GIB <= value <= MAX_KV_CACHE_GIB:
        parsed = option.type(repr(value))
        assert parsed == value
        assert 2**20 <= int(parsed * GIB) <= int(MAX_KV_CACHE_GIB * GIB)
    else:
        with pytest.raises(ValueError, match="must be from 1/1024"):
            option.type(repr(value) if math.isfinite(value) else str(value))
