"""Slow clients from one address cannot starve keyed clients from another (a real server process).

A slow-loris client on 127.0.0.1 opens many connections and sends their request heads a byte at a
time; a keyed client on 127.0.0.2 (Linux routes all of 127/8 to the loopback interface, so a
socket bound there reaches the server on 127.0.0.1 from another address) sends ordinary requests
meanwhile. The server holds at most ``--max-header-connections-per-address`` of the slow ones
(the others are closed at once, outside ``--max-connections``), and cuts every one of those at
``--header-timeout-s`` however steadily its bytes come. Every wait is bounded; nothing is timed
but against generous deadlines.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import pytest

from batchgen.server.connection_limits import HeadWaits, client_address
from tests.keys import create_key
from tests.live import LiveServer

ServerFactory = Callable[..., LiveServer]
SLOW_ADDRESS = "127.0.0.1"
KEYED_ADDRESS = "127.0.0.2"
#: The start of a request head that the slow client never finishes.
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000


def _server_port(server: LiveServer) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def _slow_connection(port: int, *, silent: bool = False) -> socket.socket:
    """A connection from ``SLOW_ADDRESS`` that has sent the first byte of a head (nothing: ``silent``)."""
    sock = socket.socket()
    sock.bind((SLOW_ADDRESS, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not silent:
        sock.sendall(SLOW_HEAD[:1])
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (it sends nothing else to a head it never got whole)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536) == b""
    except OSError:  # reset
        return True


def _keyed_client(server: LiveServer, key: str) -> httpx.Client:
    """A client from ``KEYED_ADDRESS`` sending ``key``, on a fresh connection for every request."""
    transport = httpx.HTTPTransport(
        local_address=KEYED_ADDRESS, limits=httpx.Limits(max_keepalive_connections=0)
    )
    return httpx.Client(
        base_url=server.base_url, transport=transport, timeout=30, headers={"Authorization": f"Bearer {key}"}
    )


def _keyed_outcomes(client: httpx.Client, requests: int, every_s: float = 0.0) -> list[str]:
    """The statuses (or errors) of ``requests`` keyed calls, one after another, at most one every
    ``every_s``."""
    outcomes = []
    for turn in range(requests):
        started = time.monotonic()
        try:
            outcomes.append(str(client.get("/v1/models" if turn % 2 else "/v1/batches").status_code))
        except httpx.HTTPError as exc:
            outcomes.append(type(exc).__name__)
        time.sleep(max(0.0, every_s - (time.monotonic() - started)))
    return outcomes


def _health_latency(client: httpx.Client) -> float:
    started = time.monotonic()
    assert client.get("/health").status_code == 200
    return time.monotonic() - started


def _keyed_server(server_factory: ServerFactory, tmp_path: Path, *flags: str) -> tuple[LiveServer, str]:
    _, key = create_key(tmp_path / "storage", "alice")
    return server_factory("--max-connections", "40", "--max-header-connections-per-address", "8", *flags), key


def test_one_address_holds_at_most_the_cap_of_unfinished_heads_and_keyed_clients_elsewhere_succeed(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """Beyond 8 unfinished heads from 127.0.0.1, its connections are closed at once and take none
    of the 40 slots: 60 of them, far more than the slots, leave keyed requests from 127.0.0.2 alone.
    A head completed frees its place under the cap."""
    server, key = _keyed_server(server_factory, tmp_path, "--header-timeout-s", "120")
    port = _server_port(server)
    with contextlib.ExitStack() as stack, _keyed_client(server, key) as keyed:
        held = [stack.enter_context(_slow_connection(port)) for _ in range(8)]
        assert _health_latency(keyed) < 30  # a round trip: the server has taken the first 8 in
        beyond = [stack.enter_context(_slow_connection(port)) for _ in range(52)]
        deadline = time.monotonic() + 30
        open_beyond = list(beyond)
        while open_beyond:
            assert time.monotonic() < deadline, f"{len(open_beyond)} connections beyond the cap still open"
            open_beyond = [sock for sock in open_beyond if not _closed_by_server(sock)]
            time.sleep(0.05)
        assert not any(_closed_by_server(sock) for sock in held), "a connection within the cap was closed"

        outcomes = _keyed_outcomes(keyed, 40)
        assert outcomes.count("200") >= 0.95 * len(outcomes), outcomes
        assert _health_latency(keyed) < 5

        # one of the 8 finishes its head: answered, and 127.0.0.1 may open one more connection
        held[0].sendall(SLOW_HEAD[1:] + b"\r\nConnection: close\r\n\r\n")
        held[0].settimeout(30)
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200 ")
        again = stack.enter_context(_slow_connection(port))
        assert _health_latency(keyed) < 30  # the server has taken it in by now
        assert not _closed_by_server(again)


@attrs.define
class SlowLoris:
    """``connections`` connections from ``SLOW_ADDRESS``, each sending one more byte of a head
    that never ends every ``byte_every_s``; one the server closes is opened again within
    ``TICK_S``, so the connections it keeps leave hardly a gap."""

    TICK_S = 0.1

    port: int
    connections: int
    byte_every_s: float = 0.5
    #: Connections that send nothing at all (the server closes them when they have waited too long).
    silent: bool = False
    #: For each connection the server closed: how long it was open, and how many bytes it sent.
    cut: list[tuple[float, int]] = attrs.field(factory=list)
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None

    def cut_while_sending(self) -> int:
        """How many connections the server closed after they had sent 4 bytes (over 1.5 s)."""
        return sum(1 for _, sent in self.cut if sent >= 4)

    def __enter__(self) -> SlowLoris:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _run(self) -> None:
        held: dict[socket.socket, tuple[float, int]] = {}  # its opening and bytes sent
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                for sock, (opened, sent) in list(held.items()):
                    if _closed_by_server(sock):
                        self.cut.append((now - opened, sent))
                        del held[sock]
                        sock.close()
                    elif not self.silent and now - opened >= sent * self.byte_every_s:  # next byte due
                        with contextlib.suppress(OSError):
                            sock.sendall(SLOW_HEAD[sent : sent + 1])
                            held[sock] = (opened, sent + 1)
                while len(held) < self.connections and not self._stop.is_set():
                    with contextlib.suppress(OSError):
                        sock = _slow_connection(self.port, silent=self.silent)
                        held[sock] = (time.monotonic(), 0 if self.silent else 1)
                self._stop.wait(self.TICK_S)
        finally:
            for sock in held:
                sock.close()


@pytest.fixture
def keyed_server(server_factory: ServerFactory, tmp_path: Path) -> tuple[LiveServer, str]:
    return _keyed_server(server_factory, tmp_path, "--header-timeout-s", "2")


def test_a_slow_loris_is_cut_at_the_head_deadline_however_steady_while_keyed_clients_succeed(
    keyed_server: tuple[LiveServer, str],
) -> None:
    """50 slow connections from 127.0.0.1 (40 slots), a byte from each every half second, each
    reopened once closed: keyed requests from 127.0.0.2, spread over several head deadlines, still
    succeed, and every slow connection the server kept is cut at the 2 s head deadline although
    it kept sending."""
    server, key = keyed_server
    with SlowLoris(_server_port(server), 50) as slow, _keyed_client(server, key) as keyed:
        deadline = time.monotonic() + 60
        while not slow.cut_while_sending():  # one the server kept, sending, cut at the deadline
            assert time.monotonic() < deadline, "no slow connection was cut by the head deadline"
            time.sleep(0.1)
        cut_before = slow.cut_while_sending()
        outcomes = _keyed_outcomes(keyed, 40, every_s=0.15)
        assert outcomes.count("200") >= 0.95 * len(outcomes), outcomes
        latency = _health_latency(keyed)
        assert latency < 5, f"/health took {latency:.2f} s beside the slow loris"
        while slow.cut_while_sending() < cut_before + 8:  # and the next ones the server kept too
            assert time.monotonic() < deadline, "the later slow connections were not cut"
            time.sleep(0.1)
    # kept alive by bytes, none lasted much past the deadline (generously: no idle timeout would
    # ever cut a connection sending every half second)
    longest = max(open_s for open_s, _ in slow.cut)
    assert longest < 30, f"a slow connection stayed open {longest:.1f} s"


def test_connections_reopened_at_the_cap_as_fast_as_they_are_closed_take_no_slot(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """300 silent connections from 127.0.0.1 against 40 slots: 8 wait for their heads (the cap),
    and the rest, each closed once it has sent nothing for a moment, are opened again at once, so
    hundreds are always waiting to be closed. They never count against the slots, so every keyed
    request from 127.0.0.2 is answered, none refused for want of a slot."""
    server, key = _keyed_server(server_factory, tmp_path, "--header-timeout-s", "120")
    port = _server_port(server)
    with SlowLoris(port, 300, silent=True) as slow, _keyed_client(server, key) as keyed:
        deadline = time.monotonic() + 60
        while len(slow.cut) < 300:  # the churn is well under way
            assert time.monotonic() < deadline, f"only {len(slow.cut)} connections were closed in 60 s"
            time.sleep(0.05)
        outcomes = _keyed_outcomes(keyed, 40)
        churned = len(slow.cut)
    assert outcomes == ["200"] * 40, outcomes
    assert churned > 300, "the connections beyond the cap stopped arriving"


@pytest.mark.parametrize(
    ("peername", "address"),
    [
        (("203.0.113.7", 51000), "203.0.113.7"),
        (("::ffff:203.0.113.7", 51000, 0, 0), "203.0.113.7"),
        (("2001:db8:1:2:aaaa::1", 51000, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 51000, 0, 0), "2001:db8:1:2::/64"),
        (("fe80::1%eth0", 51000, 0, 2), "fe80::/64"),
        ("", "local"),
        (None, "local"),
    ],
)
def test_connections_are_counted_by_ipv4_address_or_ipv6_network(peername: object, address: str) -> None:
    assert client_address(peername) == address


def test_head_waits_hold_each_address_to_its_cap_alone() -> None:
    waits = HeadWaits(2)
    assert waits.enter("198.51.100.1") and waits.enter("198.51.100.1")
    assert not waits.enter("198.51.100.1")
    assert waits.enter("198.51.100.2"), "another address has its own cap"
    waits.leave("198.51.100.1")
    assert waits.waiting("198.51.100.1") == 1 and waits.enter("198.51.100.1")
