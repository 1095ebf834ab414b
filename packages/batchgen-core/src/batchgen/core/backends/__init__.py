"""Inference backends behind one ``Backend`` protocol, found by name through entry points.

Each backend is one module ending in a ``BackendSpec`` that a package registers under the
``batchgen.backends`` entry-point group; ``load_backend("simulated", ...)`` finds it there and
builds it. Backend modules import their engines only when started, so importing
``batchgen.core`` or listing the backends never imports torch or sglang.
"""

from batchgen.core.backends.base import (
    Backend,
    BackendUnavailable,
    GroupingBackend,
    Outcome,
    ReportOutcome,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
    generate_all,
    generate_each,
)
from batchgen.core.backends.registry import (
    BackendLoadError,
    UnknownBackend,
    backend_names,
    backend_spec,
    backend_specs,
    load_backend,
)
from batchgen.core.backends.spec import BackendOption, BackendSpec

__all__ = [
    "Backend",
    "BackendLoadError",
    "BackendOption",
    "BackendSpec",
    "BackendUnavailable",
    "GroupingBackend",
    "Outcome",
    "ReportOutcome",
    "RequestAborted",
    "RequestRejected",
    "TransientBackendError",
    "UnknownBackend",
    "backend_names",
    "backend_spec",
    "backend_specs",
    "generate_all",
    "generate_each",
    "load_backend",
]
