"""Finding backends: every ``BackendSpec`` registered under the ``batchgen.backends`` entry points.

The built-in backends are registered by ``batchgen-core``'s own ``pyproject.toml``, exactly as a
separate package registers its own (see docs/backends-writing.md):

| name           | spec                                        | what it drives                          |
|----------------|---------------------------------------------|-----------------------------------------|
| `transformers` | `batchgen.core.backends.hf_transformers:SPEC` | torch + transformers in a worker process |
| `sglang`       | `batchgen.core.backends.sglang_engine:SPEC`   | SGLang's in-process offline `Engine`  |
| `openai`       | `batchgen.core.backends.openai_upstream:SPEC` | OpenAI-compatible HTTP servers        |
| `simulated`    | `batchgen.core.backends.simulated:SPEC`       | nothing: deterministic stand-in text  |
| `embeddings`   | `batchgen.core.backends.hf_embeddings:SPEC`   | a sentence-transformers model (torch) |

Listing names reads package metadata only; a backend's module is imported when its spec is
asked for. Nothing is cached: a package installed while the process runs is found next time.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

from batchgen.core.backends.base import Backend
from batchgen.core.backends.spec import BackendSpec

ENTRY_POINT_GROUP = "batchgen.backends"


class UnknownBackend(ValueError):
    """No installed package registers a backend of that name."""


class BackendLoadError(ValueError):
    """A backend is registered but its spec cannot be loaded (an import error, a wrong object, two
    packages registering the same name)."""


def _registered() -> dict[str, list[EntryPoint]]:
    found: dict[str, list[EntryPoint]] = {}
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, []).append(entry_point)
    return found


def _origin(entry_point: EntryPoint) -> str:
    dist = entry_point.dist
    package = f" in {dist.name} {dist.version}" if dist is not None else ""
    return f"{entry_point.value}{package}"


def backend_names() -> list[str]:
    """The names of the installed backends, sorted."""
    return sorted(_registered())


def backend_spec(name: str) -> BackendSpec:
    """The spec of the backend called ``name``; UnknownBackend or BackendLoadError if there is none."""
    registered = _registered()
    candidates = registered.get(name)
    if not candidates:
        installed = ", ".join(sorted(registered)) or "none"
        raise UnknownBackend(f"unknown backend {name!r}; installed backends: {installed}")
    return _load(name, candidates)


def _load(name: str, candidates: list[EntryPoint]) -> BackendSpec:
    """The spec registered as ``name`` by ``candidates`` (one entry point, or BackendLoadError)."""
    if len(candidates) > 1:
        origins = " and ".join(_origin(entry_point) for entry_point in candidates)
        raise BackendLoadError(f"backend {name!r} is registered twice: {origins}; uninstall one")
    [entry_point] = candidates
    try:
        spec = entry_point.load()
    except Exception as exc:
        raise BackendLoadError(
            f"backend {name!r} ({_origin(entry_point)}) could not be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(spec, BackendSpec):
        raise BackendLoadError(
            f"backend {name!r} ({_origin(entry_point)}) is a {type(spec).__name__}, not a BackendSpec"
        )
    if spec.name != name:
        raise BackendLoadError(
            f"backend {name!r} ({_origin(entry_point)}) calls itself {spec.name!r}; the names must match"
        )
    return spec


def backend_specs() -> tuple[list[BackendSpec], dict[str, str]]:
    """Every installed backend's spec, and for each one that cannot be loaded, why."""
    specs: list[BackendSpec] = []
    failures: dict[str, str] = {}
    registered = _registered()  # one read of the metadata for them all
    for name in sorted(registered):
        try:
            specs.append(_load(name, registered[name]))
        except BackendLoadError as exc:
            failures[name] = str(exc)
    return specs, failures


def load_backend(name: str, **options: Any) -> Backend:
    """Build the backend called ``name`` with ``options``, its factory's keyword arguments."""
    return backend_spec(name).build(**options)
