"""What an engine says it is doing now: the requests it is computing, the tokens it has made.

The service admits requests to its slots (``--max-pool-size``) and hands them to the backend;
how many of those the engine is actually computing is the backend's to say, and only some can.
A backend that can tell defines ``engine_activity()``, cheap and non-blocking like ``health``
(state it already keeps), returning an ``EngineActivity``; a backend without it, or that leaves a
field None, cannot tell, and the service then says only what it admitted.

- ``running``: requests the engine is computing at this moment (the transformers worker's rows
  in its running batch, counted by request; the simulated engine's requests inside its
  capacity). Admitted requests beyond it wait inside the backend for the engine.
- ``generated_tokens``: tokens the engine has generated since the backend started, counted as
  they are made (the transformers worker reports its count with each heartbeat), so a rate of it
  moves while long answers are still being written rather than only when they end.

What each built-in backend reports: transformers both; simulated ``running``; openai and
sglang neither (an upstream server or SGLang's scheduler queues requests where we cannot see).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

__all__ = ["UNKNOWN_ACTIVITY", "EngineActivity", "activity_of", "combined_activity"]


@attrs.frozen
class EngineActivity:
    """One engine's report, or several engines' together; None: cannot tell."""

    running: int | None = None
    generated_tokens: int | None = None


UNKNOWN_ACTIVITY = EngineActivity()


def activity_of(backend: Any) -> EngineActivity:
    """The backend's report, or ``UNKNOWN_ACTIVITY`` when it gives none (or a broken one)."""
    report = getattr(backend, "engine_activity", None)
    if report is None:
        return UNKNOWN_ACTIVITY
    try:
        found = report()
    except Exception:  # a report is a nicety: never let it break the pool status
        return UNKNOWN_ACTIVITY
    return found if isinstance(found, EngineActivity) else UNKNOWN_ACTIVITY


def combined_activity(backends: Iterable[Any]) -> EngineActivity:
    """The sum over ``backends``; a field is known only when every backend knows it."""
    reports = [activity_of(backend) for backend in backends]
    running = [report.running for report in reports]
    tokens = [report.generated_tokens for report in reports]
    return EngineActivity(
        running=None if not reports or None in running else sum(r for r in running if r is not None),
        generated_tokens=None if not reports or None in tokens else sum(t for t in tokens if t is not None),
    )
