"""Why a server could not start, as one paragraph instead of a traceback.

A backend that cannot start (its engine is not installed, its model cannot be loaded) raises
``BackendUnavailable`` from the service's start, inside the ASGI lifespan. Litestar hands uvicorn
the whole formatted traceback (exception groups included, some 50 lines with the reason at the
bottom). ``StartFailures`` wraps the app, keeps the reason and blanks the traceback, so the command
can print the reason as its one-paragraph refusal. A start cut short because the server was
asked to stop (Ctrl-C reaches a backend's worker process too, which ends its model's load) is no
failure either: its traceback goes too. Any other exception is a bug and keeps its traceback. ``port_taken`` says whether another program already listens where the server would.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from batchgen.core.backends.base import BackendUnavailable

Message = MutableMapping[str, Any]


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def unavailable_reason(exc: BaseException | None) -> str | None:
    """The message of the ``BackendUnavailable`` in ``exc`` (or in its groups), else None."""
    if exc is None:
        return None
    for leaf in _leaves(exc):
        if isinstance(leaf, BackendUnavailable):
            return str(leaf)
    return None


class StartFailures:
    """An ASGI app that passes everything to ``app`` and keeps why its lifespan failed to start."""

    def __init__(
        self, app: Callable[..., Awaitable[None]], stopping: Callable[[], bool] = lambda: False
    ) -> None:
        self.app = app
        #: Whether the server was asked to stop (a failed start is then no failure).
        self.stopping = stopping
        self.reason: str | None = None

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
                reason = unavailable_reason(sys.exc_info()[1])
                if reason is not None or self.stopping():
                    self.reason = reason
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
