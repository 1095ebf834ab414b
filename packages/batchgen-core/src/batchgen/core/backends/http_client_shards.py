"""The ``openai`` backend's HTTP clients: several small connection pools instead of one large one.

httpcore's connection pool walks every connection it holds on each request it sends and on each
response it closes (to find an idle connection and to drop expired ones, asking each idle one's
socket whether it is readable), and for every idle connection it finds it counts the connections
again: the cost of one request grows with the square of the connections a pool holds. One pool
with a thousand requests in flight spends most of the server's CPU walking. Measured with py-spy on
``batchgen-server --backend openai`` running 1,024 requests against one ``vllm serve``
(``benchmarks/vllm_overhead.py``, path ``openai``): more than half of the server's samples were in
that walk with one pool, a quarter with pools of 64, and it leaves the top of the profile with
pools of 16.

``ClientShards`` keeps requests in flight spread over clients of at most ``SHARD_REQUESTS`` each:
a request takes the least busy client, and a new client is made only when every one has that
many. A server with a few requests in flight has one client, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

#: Requests in flight on one client before the next one is made.
SHARD_REQUESTS = 16


@attrs.define
class ClientShards:
    """HTTP clients made by ``make`` on demand; ``client()`` lends the least busy one."""

    make: Callable[[], Any]
    shard_requests: int = SHARD_REQUESTS
    _clients: list[Any] = attrs.field(init=False, factory=list)
    _in_flight: list[int] = attrs.field(init=False, factory=list)

    @property
    def clients(self) -> int:
        """How many clients have been made."""
        return len(self._clients)

    def first(self) -> Any:
        """The first client (made if none is yet): for the few requests that need no spreading."""
        if not self._clients:
            self._add()
        return self._clients[0]

    @contextmanager
    def client(self) -> Iterator[Any]:
        """The least busy client for one request, counted as busy with it until the block ends."""
        index = min(range(len(self._clients)), key=self._in_flight.__getitem__, default=None)
        if index is None or self._in_flight[index] >= self.shard_requests:
            index = self._add()
        self._in_flight[index] += 1
        try:
            yield self._clients[index]
        finally:
            self._in_flight[index] -= 1

    async def aclose(self) -> None:
        """Close every client (their connections with them)."""
        clients, self._clients, self._in_flight = self._clients, [], []
        for client in clients:
            await client.aclose()

    def _add(self) -> int:
        self._clients.append(self.make())
        self._in_flight.append(0)
        return len(self._clients) - 1
