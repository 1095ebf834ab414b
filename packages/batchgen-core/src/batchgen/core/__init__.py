"""BatchGen core: the batch service without HTTP.

Pools, scheduler, storage and inference backends behind small interfaces, and ``BatchService``,
the facade the REST server uses and a custom pipeline can embed in-process.

The subpackages are the architecture: ``requests`` (what one line may hold), ``backends`` (the
engines), ``scheduling`` (pools and turns), ``files``, ``batches``, ``execution`` (running admitted
requests), ``storage`` and ``work`` (shards shared by replicas). Modules that moved into them keep
their old import paths (``moved_modules``).
"""

from batchgen.core import moved_modules
from batchgen.core.backends import Backend, load_backend
from batchgen.core.errors import (
    BatchGenError,
    Conflict,
    IntakeFull,
    InvalidBatchFile,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
)
from batchgen.core.models import Batch, BatchParameters, BatchStatus, FileObject, PoolStatus
from batchgen.core.service import BatchService, ServiceSettings
from batchgen.core.tenancy import Caller, TenantLimits

__all__ = [
    "Backend",
    "Batch",
    "BatchGenError",
    "BatchParameters",
    "BatchService",
    "BatchStatus",
    "Caller",
    "Conflict",
    "FileObject",
    "IntakeFull",
    "InvalidBatchFile",
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "PoolStatus",
    "ServiceSettings",
    "ServiceUnavailable",
    "TenantLimits",
    "load_backend",
]

moved_modules.install()
