"""How the server bounds its connections: a connection limit, idle and header timeouts, file descriptors.

uvicorn serves the app with ``limit_concurrency`` (requests beyond it get a 503 at once) and
``timeout_keep_alive`` (an idle keep-alive connection is closed). uvicorn has no timeout for a
connection that never finishes sending its request headers (an idle socket, or a slow-loris
client), so ``HeaderTimeoutProtocol`` adds one: a connection whose next request's headers are not
complete within ``header_timeout_s`` of its opening (or of its first byte, between requests) is
closed. Slow request bodies are cut by ``body_timeout``. At start the soft limit on open files is
raised towards the hard limit, so the connection limit is reached long before file descriptors run
out.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from batchgen.server.settings import ServerSettings

logger = logging.getLogger("batchgen.server")

#: File descriptors kept for what is not a client connection (the database, result files, logs).
RESERVED_FILE_DESCRIPTORS = 256


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers take too long."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_timer()  # part of the next request's headers: they must complete in time
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class with its header timeout set (uvicorn takes a class, not an instance)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})


def raise_open_file_limit(max_connections: int) -> int:
    """Raise the soft limit on open files so ``max_connections`` fit beside the server's own files
    (as far as the hard limit allows); return the connection limit the descriptors can carry."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + RESERVED_FILE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return max_connections
    fitting = max(soft - RESERVED_FILE_DESCRIPTORS, 1)
    logger.warning(
        "the open-file limit is %d, so at most %d connections are allowed instead of --max-connections %d",
        soft,
        fitting,
        max_connections,
    )
    return fitting


def uvicorn_config(
    app: Any, settings: ServerSettings, *, max_connections: int | None = None
) -> uvicorn.Config:
    """The uvicorn configuration serving ``app`` with the settings' limits and timeouts."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # the server configures logging itself (log_format)
        access_log=settings.access_log or settings.log_level == "debug",
        http=header_timeout_protocol(settings.header_timeout_s),
        limit_concurrency=max_connections or settings.max_connections,
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout_s)),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
