"""Backend lookup by name; each backend module is imported only when it is asked for.

| name           | module             | what it drives                                             |
|----------------|--------------------|------------------------------------------------------------|
| `transformers` | `hf_transformers`  | torch + transformers in this process (the CPU default)     |
| `sglang`       | `sglang_engine`    | SGLang's in-process offline `Engine` (the GPU engine)      |
| `openai`       | `openai_upstream`  | OpenAI-compatible HTTP servers you already run             |
| `simulated`    | `simulated`        | nothing: deterministic stand-in results for tests, benches |
"""

from __future__ import annotations

from typing import Any

from batchgen.core.backends.base import Backend

BACKEND_NAMES = ("transformers", "sglang", "openai", "simulated")


def load_backend(name: str, **options: Any) -> Backend:
    """Build the backend called ``name`` with its options (see each backend's constructor)."""
    if name == "simulated":
        from batchgen.core.backends.simulated import SimulatedBackend

        return SimulatedBackend(**options)
    if name == "transformers":
        from batchgen.core.backends.hf_transformers import TransformersBackend

        return TransformersBackend(**options)
    if name == "sglang":
        from batchgen.core.backends.sglang_engine import SGLangBackend

        return SGLangBackend(**options)
    if name == "openai":
        from batchgen.core.backends.openai_upstream import OpenAIUpstreamBackend

        return OpenAIUpstreamBackend(**options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
