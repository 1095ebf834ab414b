"""The global intake on a real PostgreSQL: replicas together never admit past a limit.

Admission (``PostgresShardLedger.add_batch`` with ``IntakeLimits``) counts what every replica
holds: the unfinished lines of running batches, overall and per tenant, and a tenant's running
batches. A Hypothesis state machine admits and cancels batches of two tenants through three
ledgers (three replicas' pools) and checks every decision against a model; concurrent admissions
from the three pools never pass the capacity together; committed lines free what they held.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Coroutine
from typing import Any, TypeVar

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from batchgen.core.work.intake import CAPACITY, TENANT_ACTIVE, TENANT_QUEUED, IntakeFull, IntakeLimits
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.shards import OUTPUT, SegmentPart
from tests.examples import examples

pytestmark = pytest.mark.live

LIMITS = IntakeLimits(capacity=1000, tenant_queued=700, tenant_active=3)
T = TypeVar("T")


def test_limits_are_bounded_where_they_are_given() -> None:
    for bad in (-1, 2**62 + 1):
        with pytest.raises(ValueError):
            IntakeLimits(capacity=bad)
        with pytest.raises(ValueError):
            IntakeLimits(tenant_queued=bad)
    assert IntakeLimits(capacity=0).capacity == 0


@attrs.define
class _Model:
    """The batches running, by id: (tenant, lines not finished)."""

    running: dict[str, tuple[str, int]] = attrs.field(factory=dict)

    def refusal(self, limits: IntakeLimits, tenant: str, lines: int) -> str | None:
        queued = sum(left for _, left in self.running.values())
        mine = [left for owner, left in self.running.values() if owner == tenant]
        if limits.capacity is not None and queued + lines > limits.capacity:
            return CAPACITY
        if limits.tenant_queued is not None and sum(mine) + lines > limits.tenant_queued:
            return TENANT_QUEUED
        if limits.tenant_active is not None and len(mine) + 1 > limits.tenant_active:
            return TENANT_ACTIVE
        return None


class IntakeMachine(RuleBasedStateMachine):
    """Admissions and cancels through three replicas' ledgers on one database."""

    url: str
    admitted = Bundle("admitted")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.ledgers = [self.run(self._open()) for _ in range(3)]
        self.run(self.ledgers[0].create_schema())
        self.run(self.ledgers[0]._rows("TRUNCATE batch_work CASCADE"))
        self.model = _Model()
        self.names = itertools.count()

    async def _open(self) -> PostgresShardLedger:
        ledger = PostgresShardLedger(self.url)
        await ledger.open()
        return ledger

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        for ledger in self.ledgers:
            self.run(ledger.close())
        self.loop.close()

    @rule(
        target=admitted,
        replica=st.integers(0, 2),
        tenant=st.sampled_from(["tenant-a", "tenant-b"]),
        lines=st.integers(0, 450),
    )
    def admit(self, replica: int, tenant: str, lines: int) -> str:
        batch_id = f"batch_{next(self.names)}"
        expected = self.model.refusal(LIMITS, tenant, lines)
        try:
            added = self.run(
                self.ledgers[replica].add_batch(batch_id, lines, 100, tenant=tenant, limits=LIMITS)
            )
        except IntakeFull as full:
            assert full.reason == expected, (full.reason, expected, str(full))
            return "refused"
        assert expected is None and added
        if lines:  # an empty batch is finished at once and holds nothing
            self.model.running[batch_id] = (tenant, lines)
        return batch_id

    @rule(batch_id=consumes(admitted), replica=st.integers(0, 2))
    def cancel(self, batch_id: str, replica: int) -> None:
        if batch_id == "refused":
            return
        self.run(self.ledgers[replica].cancel(batch_id))
        self.model.running.pop(batch_id, None)

    @rule(batch_id=admitted, replica=st.integers(0, 2))
    def add_again(self, batch_id: str, replica: int) -> None:
        """A second replica starting a batch that is there already changes nothing, even full."""
        if batch_id == "refused":
            return
        again = self.run(
            self.ledgers[replica].add_batch(
                batch_id, 1, 100, tenant="tenant-a", limits=IntakeLimits(capacity=0)
            )
        )
        assert again is False

    @invariant()
    def held_is_the_model(self) -> None:
        rows = self.run(
            self.ledgers[0]._rows(
                "SELECT batch_id, tenant, line_count - completed - failed FROM batch_work WHERE status = 'running'"
            )
        )
        assert {batch: (tenant, left) for batch, tenant, left in rows} == self.model.running


def test_admissions_and_cancels_through_three_replicas_match_the_model(postgres_url: str) -> None:
    IntakeMachine.url = postgres_url
    run_state_machine_as_test(
        IntakeMachine, settings=settings(max_examples=examples(40), stateful_step_count=30)
    )


@pytest.mark.anyio
async def test_concurrent_admissions_from_three_replicas_never_pass_the_capacity(postgres_url: str) -> None:
    capacity = 2000
    limits = IntakeLimits(capacity=capacity)
    sizes = [random.randint(1, 400) for _ in range(40)]
    ledgers = [PostgresShardLedger(postgres_url) for _ in range(3)]
    for ledger in ledgers:
        await ledger.open()
    try:
        await ledgers[0].create_schema()

        async def admit(n: int, lines: int) -> bool:
            try:
                return await ledgers[n % 3].add_batch(f"batch_{n}", lines, 100, limits=limits)
            except IntakeFull as full:
                assert full.reason == CAPACITY
                return False

        admitted = await asyncio.gather(*(admit(n, lines) for n, lines in enumerate(sizes)))
        total = sum(lines for lines, ok in zip(sizes, admitted, strict=True) if ok)
        assert total <= capacity
        # what is admitted only grew, so each refused batch did not fit then and does not now
        assert all(total + lines > capacity for lines, ok in zip(sizes, admitted, strict=True) if not ok)
        assert any(admitted) and not all(admitted)
    finally:
        for ledger in ledgers:
            await ledger.close()


@pytest.mark.anyio
async def test_committed_lines_and_cancels_free_what_they_held(postgres_url: str) -> None:
    limits = IntakeLimits(capacity=300, tenant_active=2)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_a", 200, 100, tenant="t", limits=limits)
        with pytest.raises(IntakeFull) as full:
            await ledger.add_batch("batch_b", 150, 100, tenant="t", limits=limits)
        assert full.value.reason == CAPACITY and full.value.held.queued == 200
        [lease] = await ledger.claim("replica-a", 1, 60)
        lines = tuple(range(lease.shard.first_line, lease.shard.first_line + 60))
        part = SegmentPart(OUTPUT, "segments/batch_a/output/0/1-0.jsonl", 10, lines, failed_lines=0)
        await ledger.commit(lease, [part])
        await ledger.add_batch("batch_b", 150, 100, tenant="t", limits=limits)  # 140 + 150 fit in 300
        with pytest.raises(IntakeFull) as full:
            await ledger.add_batch("batch_c", 1, 100, tenant="t", limits=limits)
        assert full.value.reason == TENANT_ACTIVE
        await ledger.cancel("batch_a")
        await ledger.add_batch("batch_c", 1, 100, tenant="t", limits=limits)
        assert await ledger.add_batch("batch_d", 1, 100, tenant="u", limits=IntakeLimits(capacity=152))
