"""ServerSettings: every option of the ``batchgen-server`` command, and what it builds from them."""

from __future__ import annotations

from pathlib import Path

import attrs

from batchgen.core.backends import Backend, load_backend
from batchgen.core.service import ServiceSettings


@attrs.frozen
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 10900
    storage_path: Path = attrs.field(default=Path("batchgen-data"), converter=Path)
    backend: str = "simulated"
    max_intake_capacity: int = 1_000_000
    max_pool_size: int = 10_240
    max_context_length: int | None = None
    max_upload_bytes: int = 512 * 1024 * 1024
    default_max_tokens: int = 256
    fsync_interval_ms: int = 1000
    shutdown_grace_s: float = 10.0
    file_expiry_s: int | None = None
    simulated_latency_s: float = 0.0
    simulated_token_latency_s: float = 0.0
    simulated_failure_rate: float = 0.0
    simulated_seed: int = 0
    log_level: str = "info"

    def service_settings(self) -> ServiceSettings:
        return ServiceSettings(
            storage_path=self.storage_path,
            max_intake_capacity=self.max_intake_capacity,
            max_pool_size=self.max_pool_size,
            max_upload_bytes=self.max_upload_bytes,
            default_max_tokens=self.default_max_tokens,
            fsync_interval_ms=self.fsync_interval_ms,
            shutdown_grace_s=self.shutdown_grace_s,
            file_expiry_s=self.file_expiry_s,
        )

    def build_backend(self) -> Backend:
        if self.backend == "simulated":
            options: dict[str, object] = {
                "latency_s": self.simulated_latency_s,
                "token_latency_s": self.simulated_token_latency_s,
                "failure_rate": self.simulated_failure_rate,
                "seed": self.simulated_seed,
            }
            if self.max_context_length is not None:
                options["context_length"] = self.max_context_length
            return load_backend("simulated", **options)
        return load_backend(self.backend)
