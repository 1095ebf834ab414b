"""The openai backend's HTTP clients (``backends.http_client_shards``): requests in flight spread
over small pools, for any order of requests starting and ending (a Hypothesis state machine).

Invariants: no client has more than ``shard_requests`` requests in flight; a new client is made
only when every client made before is full, so no more clients exist than the peak of requests
in flight needs; every client lent is counted until its request ends, and ``aclose`` closes each
client once.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any

import anyio
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from batchgen.core.backends.http_client_shards import ClientShards


class FakeClient:
    """Stands in for ``httpx.AsyncClient``: only ``aclose`` is called by the shards."""

    def __init__(self) -> None:
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


class ShardsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[FakeClient] = []
        self.shard_requests = 3
        self.shards = ClientShards(self._make, shard_requests=self.shard_requests)
        self.running: list[tuple[ExitStack, Any]] = []
        self.peak = 0

    def _make(self) -> FakeClient:
        self.made.append(FakeClient())
        return self.made[-1]

    @rule()
    def start_a_request(self) -> None:
        free_before = [client for client in self.made if self._in_flight(client) < self.shard_requests]
        stack = ExitStack()
        client = stack.enter_context(self.shards.client())
        if free_before:  # the least busy of the clients with room, no new one
            assert client in free_before
            assert self._in_flight(client) == min(self._in_flight(c) for c in free_before)
        else:
            assert client is self.made[-1] and self._in_flight(client) == 0
        self.running.append((stack, client))
        self.peak = max(self.peak, len(self.running))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def end_a_request(self, data: st.DataObject) -> None:
        stack, _ = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        stack.close()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def a_request_fails(self, data: st.DataObject) -> None:
        stack, _ = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        try:
            with stack:
                raise OSError("connection reset")
        except OSError:
            pass

    def _in_flight(self, client: FakeClient) -> int:
        return sum(1 for _, lent in self.running if lent is client)

    @invariant()
    def no_client_is_over_its_share_and_none_is_made_early(self) -> None:
        assert all(self._in_flight(client) <= self.shard_requests for client in self.made)
        assert self.shards.clients == len(self.made) <= max(1, math.ceil(self.peak / self.shard_requests))

    def teardown(self) -> None:
        for stack, _ in self.running:
            stack.close()
        anyio.run(self.shards.aclose)
        assert all(client.closed == 1 for client in self.made)
        assert self.shards.clients == 0


TestClientShards = ShardsMachine.TestCase


def test_first_makes_one_client_and_lends_it_again() -> None:
    made: list[FakeClient] = []

    def make() -> FakeClient:
        made.append(FakeClient())
        return made[-1]

    shards = ClientShards(make, shard_requests=2)
    assert shards.first() is shards.first() is made[0]
    with shards.client() as a, shards.client() as b:
        assert a is b is made[0]  # room for two on the first
        with shards.client() as c:
            assert c is made[1]
    assert shards.clients == 2
