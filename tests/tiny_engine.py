"""The transformers backend's decode engine over the tiny model, driven step by step in-process.

``tiny_engine`` (or ``load_tiny_engine``) loads a ``DecodeEngine`` (float32 on the CPU, so no result depends on the CPU's
bfloat16 support) and closes it after; ``run_to_end`` adds requests and steps the engine until it
is idle, checking that each request ends exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchgen.core.backends.hf_decode import DecodeEngine, Outcome
from batchgen.core.models import GenerationRequest


def load_tiny_engine(
    model: Path, cache_dir: Path, *, max_batch_size: int = 8, **options: Any
) -> DecodeEngine:
    """A loaded engine over ``model`` (the tiny one); the caller closes it."""
    engine = DecodeEngine(
        model=str(model),
        cache_dir=cache_dir,
        device="cpu",
        dtype="float32",
        max_batch_size=max_batch_size,
        context_length=None,
        **options,
    )
    engine.load()
    return engine


@contextmanager
def tiny_engine(
    model: Path, cache_dir: Path, *, max_batch_size: int = 8, **options: Any
) -> Iterator[DecodeEngine]:
    """A loaded engine over ``model`` (the tiny one), closed when the block ends."""
    engine = load_tiny_engine(model, cache_dir, max_batch_size=max_batch_size, **options)
    try:
        yield engine
    finally:
        engine.close()


def run_to_end(engine: DecodeEngine, *requests: GenerationRequest) -> dict[str, Outcome]:
    """Each request's outcome, by request id, once the engine has nothing left to do."""
    for request in requests:
        engine.add(request)
    outcomes: dict[str, Outcome] = {}
    while engine.busy:
        for outcome in engine.step():
            assert outcome.request_id not in outcomes, "each request ends once"
            outcomes[outcome.request_id] = outcome
    return outcomes
