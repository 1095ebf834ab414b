"""How the server bounds its connections: limits, timeouts, request framing, file descriptors, shutdown.

uvicorn serves the app with ``limit_concurrency`` (requests beyond it get a 503 at once) and
``timeout_keep_alive`` (an idle keep-alive connection is closed). ``EdgeProtocol``, uvicorn's h11
protocol with what it lacks, adds:

- a header timeout: a connection whose next request's headers are not complete within
  ``header_timeout_s`` of its opening (or of its first byte, between requests) is closed (an idle
  socket, or a slow-loris client), however steadily its bytes trickle in;
- a cap per client address (``HeadWaits``, ``--max-header-connections-per-address``) on the
  connections still waiting for a request's headers (opened and not yet sent a whole head, or a
  keep-alive one that started its next request but not finished its head), so one client holding
  many slow connections cannot fill the slots that others' requests need. A connection opened
  while its address is at the cap is let in only if its first bytes (within
  ``OVER_CAP_GRACE_S``) are a whole head, as a burst of ordinary requests' are; one whose first
  bytes are not, or that sends nothing in that time, is closed at once; until its first bytes
  are read it takes none of ``limit_concurrency``'s slots, so a client reopening connections at
  its cap as fast as they are closed cannot crowd out others' requests either. An IPv6 address
  counts as its /64 network (a host usually holds a whole /64), an IPv4-mapped one as IPv4;
- the size limit of a request's head: the request line and headers, up to and including the empty
  line that ends them, may be at most ``max_header_bytes`` (``--max-header-bytes``), however the
  bytes arrive (h11's own limit applies only to a head still incomplete);
- unambiguous framing (RFC 9112 section 6.1): a request with both ``Content-Length`` and
  ``Transfer-Encoding``, or with a folded header line (which h11 would join to the line above),
  is refused, since a proxy in front may read its body differently; h11
  already refuses conflicting ``Content-Length`` values and codings other than ``chunked`` (400
  here, not h11's 501: the body's length cannot be known).
  Every such refusal is an OpenAI-shaped error and closes the connection, so no byte after it is
  read as another request;
- a gentle close: a connection closed while the client may still be sending its request (a
  refusal, or an answer given before the body was read, as ``GET /health`` with a body and
  ``Connection: close``) lingers (``LINGER_S``, at most ``LINGER_BYTES``): the server stops
  sending, then reads and drops what the client still sends, so the client reads the answer
  instead of a reset (closing a socket with unread bytes resets the connection);
- a bounded shutdown: once the server stops, a connection still receiving or answering a request
  ``shutdown_grace_s`` later is closed (an upload still arriving is cut; its handler sees the
  client leave and removes its staging file), and uvicorn cancels what is still running a moment
  after that (``SHUTDOWN_CANCEL_MARGIN_S``);
- a request id (``request_ids``) for every request: its response, whoever writes it (the app,
  uvicorn's 503 beyond the connection limit or its 500, a refusal here), carries it in
  ``x-request-id``, its access log line as ``request_id``, and the app finds it in the scope.

Slow request bodies are cut by ``body_timeout``. At start the soft limit on open files is raised
towards the hard limit, so the connection limit is reached long before file descriptors run out.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import resource
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from batchgen.server.request_ids import REQUEST_ID_HEADER, identify, new_request_id, request_id_of
from batchgen.server.settings import ServerSettings

logger = logging.getLogger("batchgen.server")

#: File descriptors kept for what is not a client connection (the database, result files, logs).
RESERVED_FILE_DESCRIPTORS = 256
#: After the shutdown grace has closed the connections, how long uvicorn lets their handlers unwind
#: (a cut upload removing its staging file) before it cancels the ones still running.
SHUTDOWN_CANCEL_MARGIN_S = 1.0
#: How long a connection closed while the client may still be sending is kept half-closed, dropping
#: what the client still sends, before it is closed (closing a socket with unread bytes resets it,
#: and the client may lose the answer), and how many bytes it drops at most.
LINGER_S = 1.0
LINGER_BYTES = 1024 * 1024
#: The default of ``--max-header-connections-per-address``.
DEFAULT_HEADER_CONNECTIONS_PER_ADDRESS = 32
#: How long a connection opened while its address is at the cap may take to send its first bytes.
OVER_CAP_GRACE_S = 0.5
#: The network an IPv6 client is counted by: a host is usually given a whole /64.
IPV6_CLIENT_PREFIX = 64
#: The end of a request's head, as h11 finds it (it accepts a bare LF for CRLF).
_END_OF_HEAD = re.compile(rb"\n\r?\n")
#: A header line continuing the one above (obsolete line folding).
_FOLDED_LINE = re.compile(rb"\n[ \t]")


class RequestRefused(h11.RemoteProtocolError):
    """A request refused before it reaches the app: the status and the OpenAI error ``code``."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message, error_status_hint=status)
        self.code = code


class StrictConnection(h11.Connection):
    """h11's server connection, also refusing a head over ``max_head_bytes`` and ambiguous framing.

    The refusal (``RequestRefused``, or h11's own ``RemoteProtocolError``) is kept in ``refusal``
    for the protocol's error response.
    """

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            if self.their_state is h11.IDLE:
                self._check_head()
            event = super().next_event()
            if isinstance(event, h11.Request):
                _check_framing(event)
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            raise
        return event

    def _check_head(self) -> None:
        """The next request's head (what of it arrived) is within the limit and has no folded line."""
        buffered, _ = self.trailing_data
        end = _END_OF_HEAD.search(buffered, 0, self.max_head_bytes)
        if end is None and len(buffered) > self.max_head_bytes:
            raise RequestRefused(
                f"The request line and headers are larger than the limit of {self.max_head_bytes} bytes.",
                431,
                "request_header_too_large",
            )
        if _FOLDED_LINE.search(buffered, 0, end.end() if end is not None else len(buffered)):
            # h11 would join it to the header above; a proxy in front may read it as a header of its own
            raise RequestRefused(
                "A header line may not be folded (a line starting with a space or tab; RFC 9112 section 5.2).",
                400,
                "invalid_request",
            )


def _check_framing(request: h11.Request) -> None:
    names = {name for name, _ in request.headers}  # h11 gives them lower-cased
    if b"transfer-encoding" in names and b"content-length" in names:
        raise RequestRefused(
            "A request may not have both Content-Length and Transfer-Encoding (RFC 9112 section 6.1).",
            400,
            "invalid_request",
        )


def client_address(peername: Any) -> str:
    """The address a connection counts against in ``HeadWaits``: its IPv4 address (an IPv4-mapped
    IPv6 one as IPv4), the /64 network of an IPv6 one, ``"local"`` for a Unix socket."""
    host = peername[0] if isinstance(peername, tuple) and peername else None
    try:
        address = ipaddress.ip_address(str(host).partition("%")[0])  # without an IPv6 zone
    except ValueError:
        return "local"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


class HeadWaits:
    """The connections waiting for a request's headers, counted per client address, at most
    ``per_address`` each. One per server (the protocol class's), shared by its connections."""

    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self._waiting: dict[str, int] = {}

    def enter(self, address: str) -> bool:
        """Count one more connection of ``address``; False (and nothing counted) at the cap."""
        waiting = self._waiting.get(address, 0)
        if waiting >= self.per_address:
            return False
        self._waiting[address] = waiting + 1
        return True

    def leave(self, address: str) -> None:
        waiting = self._waiting.pop(address, 0) - 1
        if waiting > 0:
            self._waiting[address] = waiting

    def waiting(self, address: str) -> int:
        return self._waiting.get(address, 0)


class _GentleClose:
    """The connection's transport as uvicorn's protocol sees it, but ``close`` is
    ``EdgeProtocol._close_gently``, and a lingering connection is already closing."""

    def __init__(self, transport: asyncio.Transport, protocol: EdgeProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol._close_gently()

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._protocol.lingering


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of this module's docstring (set on a subclass)."""

    header_timeout_s: float = 10.0
    max_head_bytes: int = 64 * 1024
    shutdown_grace_s: float = 10.0
    head_waits: HeadWaits = HeadWaits(DEFAULT_HEADER_CONNECTIONS_PER_ADDRESS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictConnection(self.max_head_bytes)
        self._address = "local"
        #: Whether this connection is counted in ``head_waits`` (waiting for a request's headers).
        self._waiting_for_head = False
        #: Opened at its address's cap: when it must have sent its first bytes.
        self._over_cap_timer: asyncio.TimerHandle | None = None
        #: Opened at its address's cap and not yet in ``connections`` (``limit_concurrency``'s count).
        self._uncounted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._shutdown_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_bytes_left = LINGER_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket = transport
        super().connection_made(_GentleClose(transport, self))  # type: ignore[arg-type]
        self._address = client_address(transport.get_extra_info("peername"))
        self._arm_header_timer()
        if self.head_waits.enter(self._address):
            self._waiting_for_head = True
        else:  # a burst of whole requests is let in; a slow or silent connection is closed
            # until its first bytes show a whole head it takes none of limit_concurrency's slots:
            # an address reopening many connections at its cap must not crowd out others' requests
            self.connections.discard(self)
            self._uncounted = True
            grace_s = min(OVER_CAP_GRACE_S, self.header_timeout_s)
            self._over_cap_timer = self.loop.call_later(grace_s, self._over_cap_grace_ended)

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # closing: what still arrives is dropped
            self._linger_bytes_left -= len(data)
            if self._linger_bytes_left < 0:
                self._end_linger()
            return
        self._cancel_over_cap_timer()
        self._count_again()  # judged by uvicorn's limit like any other; closed below if it must wait
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # lingering counts
            # part of the next request's headers: they must complete in time, and they count
            if self._wait_for_head():
                self._arm_header_timer()
        else:
            self._disarm_header_timer()
            if self.conn.their_state is not h11.ERROR:  # a refused head still counts while it lingers
                self._stop_waiting_for_head()

    def handle_events(self) -> None:
        """uvicorn's, naming the request whose cycle it starts (at most one per call: a pipelined
        request waits until the response before it is complete) before the cycle's task runs."""
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            request_id = identify(cycle.scope.setdefault("state", {}))
            cycle.default_headers = [*cycle.default_headers, (REQUEST_ID_HEADER, request_id.encode())]
            # uvicorn writes the access line with this logger: the adapter adds the id to its record
            cycle.access_logger = logging.LoggerAdapter(  # type: ignore[assignment]
                cycle.access_logger, {"request_id": request_id}
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._cancel_over_cap_timer()
        self._stop_waiting_for_head()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
            self._shutdown_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """The error response to a refused request (h11's status hint, or ours), closing the connection."""
        refusal = getattr(self.conn, "refusal", None)
        status = refusal.error_status_hint if refusal is not None else 400
        if status == 501:  # h11's hint for a coding other than chunked: a body of unknown length, so
            status = 400  # 400 and close (RFC 9112 section 6.3 requires it when chunked is not last)
        code = getattr(refusal, "code", "invalid_request")
        message = str(refusal) if refusal is not None else msg
        if isinstance(refusal, h11.RemoteProtocolError) and not isinstance(refusal, RequestRefused):
            message = f"Invalid HTTP request: {message}."
        self._send_error_and_close(status, message, "invalid_request_error", code, new_request_id())

    def _send_error_and_close(
        self,
        status: int,
        message: str,
        type_: str,
        code: str,
        request_id: str,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        """Answer with an OpenAI-shaped error (when no response is under way) and close the
        connection; the answer and its access log line name ``request_id``."""
        body = json.dumps(
            {"error": {"message": message, "type": type_, "param": None, "code": code}}
        ).encode()
        head = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (REQUEST_ID_HEADER, request_id.encode()),
            *headers,
        ]
        try:
            reason = HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b""
        try:
            self.transport.write(
                self.conn.send(h11.Response(status_code=status, headers=head, reason=reason))
            )
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # a response was already under way: just close (gently)
            pass
        else:
            self._log_refusal(status, request_id)
        self._linger()

    def _log_refusal(self, status: int, request_id: str) -> None:
        """The access log line of a response written here: uvicorn's form, with ``-`` for the
        method and path when no request line was read."""
        if not self.access_log:
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else ""
        request = self.cycle.scope if self.cycle is not None and not self.cycle.response_complete else None
        method, path = (request["method"], request["path"]) if request is not None else ("-", "-")
        self.access_logger.info(
            '%s - "%s %s HTTP/%s" %d', client, method, path, "1.1", status, extra={"request_id": request_id}
        )

    @property
    def lingering(self) -> bool:
        return self._linger_timer is not None

    def _close_gently(self) -> None:
        """Close the connection: at once if the client has sent its whole request (or none), else
        after lingering."""
        if self.lingering:
            return
        if self.conn.their_state in (h11.SEND_BODY, h11.ERROR):
            self._linger()
        else:
            self._socket.close()

    def _linger(self) -> None:
        """Stop sending (the answer goes first), drop what still arrives, close after ``LINGER_S``."""
        self._disarm_header_timer()
        if self.lingering:
            return
        if self._socket.is_closing() or not self._socket.can_write_eof():
            self._socket.close()
            return
        self._socket.write_eof()
        self._socket.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, self._end_linger)

    def _end_linger(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._socket.close()

    def shutdown(self) -> None:
        """The server stops: close the connection now if idle, else when ``shutdown_grace_s`` ends."""
        if self.lingering:
            self._end_linger()
            return
        super().shutdown()
        if not self.transport.is_closing() and self._shutdown_timer is None:
            self._shutdown_timer = self.loop.call_later(self.shutdown_grace_s, self._end_of_grace)

    def _end_of_grace(self) -> None:
        """Cut the request still under way: its handler sees the client leave, the client gets 503."""
        self._shutdown_timer = None
        if self.transport.is_closing():  # closed, or lingering
            return
        logger.warning(
            "shutting down: closed a connection whose request was still under way after "
            "--shutdown-grace-s %g s",
            self.shutdown_grace_s,
        )
        cycle = self.cycle
        if cycle is None or cycle.response_started or cycle.disconnected:
            self.transport.close()
            return
        cycle.disconnected = True  # what the app still sends goes nowhere; its receive() sees the end
        cycle.message_event.set()
        self._send_error_and_close(
            503,
            "The server is shutting down; this request was cut and nothing of it was kept. Send it again.",
            "server_error",
            "server_shutting_down",
            request_id_of(cycle.scope) or new_request_id(),
            ((b"retry-after", b"5"),),
        )

    def _wait_for_head(self) -> bool:
        """Count this connection in ``head_waits`` (if it is not yet); at its address's cap, close
        it at once instead, and out of the connections ``limit_concurrency`` counts: False."""
        if self._waiting_for_head:
            return True
        if self.head_waits.enter(self._address):
            self._waiting_for_head = True
            self._count_again()
            return True
        self.connections.discard(self)
        logger.warning(
            "closed a connection from %s that did not send a whole request head at once: that "
            "address already has %d connections whose request headers are not complete "
            "(--max-header-connections-per-address)",
            self._address,
            self.head_waits.per_address,
        )
        self._socket.close()
        return False

    def _count_again(self) -> None:
        """Put a connection opened at its address's cap back among those ``limit_concurrency`` counts."""
        if self._uncounted:
            self._uncounted = False
            if not self.transport.is_closing():
                self.connections.add(self)

    def _stop_waiting_for_head(self) -> None:
        if self._waiting_for_head:
            self._waiting_for_head = False
            self.head_waits.leave(self._address)

    def _over_cap_grace_ended(self) -> None:
        """Opened at its address's cap, it sent nothing in ``OVER_CAP_GRACE_S``: it waits like the
        others if a place came free, else it is closed."""
        self._over_cap_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._wait_for_head()

    def _cancel_over_cap_timer(self) -> None:
        if self._over_cap_timer is not None:
            self._over_cap_timer.cancel()
            self._over_cap_timer = None

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


def edge_protocol(settings: ServerSettings) -> type[EdgeProtocol]:
    """The protocol class with the settings' bounds (uvicorn takes a class, not an instance)."""
    bounds = {
        "header_timeout_s": settings.header_timeout_s,
        "max_head_bytes": settings.max_header_bytes,
        "shutdown_grace_s": settings.shutdown_grace_s,
        "head_waits": HeadWaits(settings.max_header_connections_per_address),
    }
    return type("EdgeProtocol", (EdgeProtocol,), bounds)


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
        http=edge_protocol(settings),
        limit_concurrency=max_connections or settings.max_connections,
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout_s)),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_graceful_shutdown=settings.shutdown_grace_s + SHUTDOWN_CANCEL_MARGIN_S,  # type: ignore[arg-type]
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
