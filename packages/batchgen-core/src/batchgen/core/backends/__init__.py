"""Inference backends behind one ``Backend`` protocol, loaded lazily by name.

``load_backend("simulated", ...)`` imports only what that backend needs, so importing
``batchgen.core`` never imports torch or sglang.
"""

from batchgen.core.backends.base import (
    Backend,
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
)
from batchgen.core.backends.registry import BACKEND_NAMES, load_backend

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendUnavailable",
    "RequestAborted",
    "RequestRejected",
    "TransientBackendError",
    "load_backend",
]
