"""Backend lookup by name; each backend module is imported only when it is asked for."""

from __future__ import annotations

from typing import Any

from batchgen.core.backends.base import Backend

BACKEND_NAMES = ("simulated",)


def load_backend(name: str, **options: Any) -> Backend:
    """Build the backend called ``name`` with its options (see each backend's constructor)."""
    if name == "simulated":
        from batchgen.core.backends.simulated import SimulatedBackend

        return SimulatedBackend(**options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
