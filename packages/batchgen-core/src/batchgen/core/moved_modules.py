"""The import paths the core's modules had before they moved into subpackages, kept working.

The core was once one flat folder (``batchgen.core.batch_tracker``,
``batchgen.core.request_schema``, ...). Each old path in ``MOVED`` now names the very module object
of its new path, so ``import``, ``from ... import`` and ``monkeypatch.setattr("old.path.name")``
act on the module the code runs. New code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

#: Old module name (under ``batchgen.core``) -> its path now (under ``batchgen.core``).
MOVED: dict[str, str] = {
    "batch_file": "files.batch_file",
    "batch_lifecycle": "batches.lifecycle",
    "batch_log": "batches.log",
    "batch_options": "batches.options",
    "batch_progress": "batches.progress",
    "batch_retry": "batches.retry",
    "batch_starter": "batches.starter",
    "batch_tracker": "batches.tracker",
    "chunked_uploads": "files.chunked_uploads",
    "deadline_watch": "batches.deadline_watch",
    "embeddings_api": "requests.embeddings_api",
    "file_catalogue": "files.catalogue",
    "json_bounds": "requests.json_bounds",
    "json_escapes": "requests.json_escapes",
    "line_blocks": "files.line_blocks",
    "line_requests": "execution.line_requests",
    "ordering_step": "batches.ordering_step",
    "output_order": "batches.output_order",
    "parameters": "requests.parameters",
    "prefix_keys": "requests.prefix_keys",
    "recovery": "batches.recovery",
    "request_executor": "execution.executor",
    "request_schema": "requests.schema",
    "responses_api": "requests.responses_api",
    "result_cache": "execution.result_cache",
    "result_cache_keys": "execution.result_cache_keys",
    "result_merge": "batches.result_merge",
    "results": "requests.results",
    "sampling_ranges": "requests.sampling_ranges",
    "served_models": "backends.served_models",
    "storage_faults": "storage.faults",
    "streamed_validation": "files.streamed_validation",
    "structured_output": "requests.structured_output",
    "upload_parts": "files.upload_parts",
    "upload_validation_worker": "files.upload_validation_worker",
    "write_behind": "files.write_behind",
}

_PACKAGE = "batchgen.core"


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module of its new path (the same object)."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != _PACKAGE or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(f"{_PACKAGE}.{MOVED[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran when its new path was imported."""


def install() -> None:
    """Let the old paths be imported (once per process)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
