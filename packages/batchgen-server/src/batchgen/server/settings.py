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
    backend: str = "transformers"
    model: str | None = None
    device: str | None = None
    max_batch_size: int = 16
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    sglang_arg: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    upstream: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    upstream_api_key: str | None = None
    upstream_model: str | None = None
    upstream_max_concurrency: int = 64
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
        """The backend ``--backend`` names, with the options that belong to it."""
        return load_backend(self.backend, **self.backend_options())

    def backend_options(self) -> dict[str, object]:
        context = {} if self.max_context_length is None else {"context_length": self.max_context_length}
        if self.backend == "simulated":
            return {
                "latency_s": self.simulated_latency_s,
                "token_latency_s": self.simulated_token_latency_s,
                "failure_rate": self.simulated_failure_rate,
                "seed": self.simulated_seed,
                **context,
            }
        if self.backend == "transformers":
            return {
                "model": self.model,
                "cache_dir": self.storage_path / "models",
                "device": self.device,
                "max_batch_size": self.max_batch_size,
                **context,
            }
        if self.backend == "sglang":
            if self.model is None:
                raise ValueError("--backend sglang needs --model-path")
            return {
                "model_path": self.model,
                "tp_size": self.tp_size,
                "dp_size": self.dp_size,
                "mem_fraction_static": self.mem_fraction_static,
                "engine_args": _key_values(self.sglang_arg),
                **context,
            }
        if self.backend == "openai":
            if not self.upstream:
                raise ValueError("--backend openai needs at least one --upstream URL")
            return {
                "upstreams": list(self.upstream),
                "api_key": self.upstream_api_key,
                "model": self.upstream_model,
                "max_concurrency": self.upstream_max_concurrency,
                **context,
            }
        return {}


def _key_values(pairs: tuple[str, ...]) -> dict[str, object]:
    """``KEY=VALUE`` strings as a dict; values that read as JSON (numbers, true, ...) are decoded."""
    import json

    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            options[key.replace("-", "_")] = value
    return options
