"""LeaseHeartbeat: renews one owner's shard leases from a thread of its own, whatever the event loop does.

A replica's event loop runs thousands of lines at once. A renewal sent from that loop waits for
its turn behind them (and for a pooled connection behind the commits), and a renewal that comes
late loses every lease. So renewals are sent from a dedicated thread (not the replica's loop, and
not a shared worker-thread pool that lines and segment writes fill) with a private event loop and
one PostgreSQL connection of its own:

- every ``ttl_s / 3`` seconds, on its own timer, it sends one renewal (``renew_held``) of the
  leases the owner holds now (``hold``: a lease the owner let go is not kept alive), which waits
  for no lock (a shard whose commit is in flight on the owner's loop is answered as busy), giving
  it up after a third of the lease (``call_timeout_s``: a partition makes calls hang, not fail),
  after which the connection is thrown away and a new one made for the next renewal;
- what came of each renewal is a ``Renewal``: when it was sent (the monotonic clock, read in this
  thread, so a busy loop does not make it look later than it was) and the leases it renewed and
  found busy, or the error. Renewals are handed to the owner's loop in order (``on_renewals``), which judges them:
  the shard runner drops the shards a renewal lost and counts each kept lease from its ``sent``.

Renewing for a loop that no longer runs would keep a wedged replica's work from everyone, so the
heartbeat renews only while the loop takes the renewals in: while one it handed over has waited
for the loop for a whole lease (a loop blocked that long, or wedged for good), it sends nothing
and hands over a failure instead; its leases run out as a dead replica's would. A loop blocked
for less than a lease loses nothing: the renewals go on meanwhile, and it reads them when it runs
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import psycopg

from batchgen.core.work.postgres_ledger import HeldRenewal, renew_held
from batchgen.core.work.shards import Lease

__all__ = ["LeaseHeartbeat", "LoopStalled", "Renewal"]

logger = logging.getLogger(__name__)


class LoopStalled(Exception):
    """The owner's event loop took no renewal for a whole lease: the heartbeat renews no more."""


@attrs.frozen
class Renewal:
    """One renewal: when it was sent (``time.monotonic``), and what the database answered
    (``answer``), or, when it failed or was not sent, why (``error``)."""

    sent: float
    answer: HeldRenewal | None = None
    error: Exception | None = None


class LeaseHeartbeat:
    """Renews ``owner_id``'s leases at the database ``url`` every third of ``ttl_s`` from a thread
    of its own, handing each ``Renewal`` to ``on_renewals`` on the loop that called ``start``."""

    def __init__(
        self,
        url: str,
        owner_id: str,
        ttl_s: float,
        on_renewals: Callable[[Sequence[Renewal]], None],
    ) -> None:
        self.url = url
        self.owner_id = owner_id
        self.ttl_s = ttl_s
        self.interval_s = ttl_s / 3
        self.call_timeout_s = ttl_s / 3
        self._on_renewals = on_renewals
        #: The leases the owner runs now: what the next renewal renews (replaced, never changed,
        #: so the thread reads one whole set).
        self._held: tuple[Lease, ...] = ()
        #: Renewals made and not yet taken in by the owner's loop (appended in the thread).
        self._made: deque[Renewal] = deque()
        self._owner_loop: asyncio.AbstractEventLoop | None = None
        self._own_loop = asyncio.new_event_loop()
        #: Set (in its thread) to renew at once, and to stop once ``stopping`` is.
        self._wake = asyncio.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{owner_id}-lease-heartbeat", daemon=True)
        self._exited: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Start renewing (from a coroutine on the loop that takes the renewals in)."""
        self._owner_loop = asyncio.get_running_loop()
        self._exited = self._owner_loop.create_future()
        self._thread.start()

    def hold(self, leases: Iterable[Lease], *, renew_now: bool = False) -> None:
        """Renew these leases from the next renewal on (the owner's whole set, each time it
        changes); ``renew_now``: send that renewal at once (a claim answered late, whose lease
        may run out before the next one)."""
        self._held = tuple(leases)
        if renew_now:
            self._wake_thread()

    def _wake_thread(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop has closed: the thread has ended
            self._own_loop.call_soon_threadsafe(self._wake.set)

    async def stop(self) -> None:
        """Stop renewing; returns once the thread has ended (a call in flight is given up)."""
        if self._exited is None:
            return
        self._stopping = True
        self._wake_thread()
        await asyncio.shield(self._exited)

    # --- in the heartbeat's thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            self._own_loop.run_until_complete(self._beat())
        except Exception:  # a bug: the runner's self-fencing lets the leases go
            logger.exception("the lease heartbeat of %s ended", self.owner_id)
        finally:
            self._own_loop.close()
            self._tell_owner(self._set_exited)

    async def _beat(self) -> None:
        connection: psycopg.AsyncConnection[Any] | None = None
        next_at = time.monotonic() + self.interval_s
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, next_at - time.monotonic()))
                self._wake.clear()
                if self._stopping:
                    return
                sent = time.monotonic()
                next_at = sent + self.interval_s
                waited_s = sent - self._oldest_untaken(sent)
                if waited_s > self.ttl_s:
                    stalled = LoopStalled(f"the event loop left a renewal untaken for {waited_s:.1f} s")
                    self._made.append(Renewal(sent, error=stalled))
                    self._tell_owner(self.hand_over)
                    continue
                try:
                    if connection is None:
                        connection = await asyncio.wait_for(self._connect(), self.call_timeout_s)
                    left_s = self.call_timeout_s - (time.monotonic() - sent)
                    answer = await asyncio.wait_for(
                        renew_held(connection, self.owner_id, self.ttl_s, self._held), left_s
                    )
                except Exception as error:  # the database is away, or cut off: a fresh connection next
                    renewal = Renewal(sent, error=error)
                    if connection is not None:
                        await _close(connection)
                        connection = None
                else:
                    renewal = Renewal(sent, answer)
                self._made.append(renewal)
                self._tell_owner(self.hand_over)
        finally:
            if connection is not None:
                await _close(connection)

    def _oldest_untaken(self, now: float) -> float:
        """When the oldest renewal the owner's loop has not taken in yet was sent (``now``: none)."""
        try:
            return self._made[0].sent
        except IndexError:  # none, or the loop took the last one in just now
            return now

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, connect_timeout=max(2, round(self.call_timeout_s))
        )

    def _tell_owner(self, callback: Callable[[], None]) -> None:
        if self._owner_loop is not None:
            with contextlib.suppress(RuntimeError):  # the owner's loop has closed
                self._owner_loop.call_soon_threadsafe(callback)

    # --- on the owner's loop --------------------------------------------------------------

    def hand_over(self) -> None:
        """Hand the renewals made so far to ``on_renewals`` (on the owner's loop). The thread asks
        the loop to call this after each renewal; the owner calls it too before judging its
        leases, so a renewal that is made but still queued behind a busy loop counts."""
        renewals = []
        while self._made:
            renewals.append(self._made.popleft())
        if renewals:
            self._on_renewals(renewals)

    def _set_exited(self) -> None:
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)


async def _close(connection: psycopg.AsyncConnection[Any]) -> None:
    with contextlib.suppress(Exception):
        await connection.close()
