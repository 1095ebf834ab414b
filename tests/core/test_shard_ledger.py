"""The shard ledger on a real PostgreSQL: leases on the database's clock, fencing, the manifest.

A Hypothesis state machine plays three replicas against one ledger and a model of what each
shard's current lease is: claims, renewals, commits (some by zombies whose lease was taken over),
releases, cancels and lease expiries in any order. Whatever the order, a claim hands out only
claimable shards, the batch with the fewest live leases first; a commit counts exactly when its
lease is the shard's current, live one and its batch runs; no line is ever committed twice; the
counters, the done shards and the manifest's bytes are exactly what was accepted; and what was
written but refused is an orphan, never served.

Besides: concurrent claims by three pools never share a shard; a lease that runs out on the
database's clock goes to the next claimer, whose epoch fences the old owner out; a Postgres that
restarts (``-m immediate``) fails the calls made while it is down and serves the next ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs
import psycopg
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from batchgen.core.work.postgres_ledger import (
    CommitRefused,
    LineCommittedTwice,
    PostgresShardLedger,
    renew_held,
)
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.segment_store import segment_key
from batchgen.core.work.shard_runner import collect_orphans
from batchgen.core.work.shards import ERRORS, OUTPUT, Lease, SegmentPart, plan_shards
from tests.examples import examples
from tests.postgres import PostgresServer

pytestmark = pytest.mark.live

T = TypeVar("T")
REPLICAS = ("replica-a", "replica-b", "replica-c")
TENANTS = ("tenant-a", "tenant-b")
HOUR_S = 3600.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _ledger(url: str) -> PostgresShardLedger:
    ledger = PostgresShardLedger(url)
    await ledger.open()
    await ledger.create_schema()
    return ledger


def _line_bytes(batch_id: str, line: int) -> bytes:
    return f'{{"custom_id": "{batch_id}-{line}"}}\n'.encode()


@attrs.define
class ShardModel:
    n_lines: int
    epoch: int = 0
    owner: str | None = None
    expired: bool = False
    done_lines: set[int] = attrs.field(factory=set)

    @property
    def done(self) -> bool:
        return len(self.done_lines) == self.n_lines

    @property
    def live_owner(self) -> str | None:
        return None if self.done or self.owner is None or self.expired else self.owner

    @property
    def claimable(self) -> bool:
        return not self.done and (self.owner is None or self.expired)


def _why_refused(shard: ShardModel, lease: Lease, replica: str, status: str) -> str:
    if status != "running":
        return f"batch {status}"
    if shard.done:
        return "shard done"
    if shard.epoch != lease.epoch:
        return "taken back by its own holder" if shard.owner == replica else "taken over"
    return "lease ran out"


@attrs.define
class BatchModel:
    created: int
    shards: dict[int, ShardModel]
    status: str = "running"
    tenant: str = "default"
    completed: int = 0
    failed: int = 0


class LedgerMachine(RuleBasedStateMachine):
    """Three replicas, one ledger, a model of every shard's lease. Every example uses the one ledger
    (and the event loop its pool belongs to) the fixture opened, emptied at the example's start: the
    ledger keeps nothing but its connections, and opening one per example cost about a tenth of
    the test's time."""

    loop: asyncio.AbstractEventLoop
    shared_ledger: PostgresShardLedger
    folder: Path

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).loop
        self.ledger = type(self).shared_ledger
        self.run(self.ledger._rows("TRUNCATE batch_work CASCADE"))
        self.segments = SegmentFiles(self.folder / f"run-{time.monotonic_ns()}")
        self.batches: dict[str, BatchModel] = {}
        #: What each replica believes it holds, by (batch id, shard number, epoch): a zombie's may
        #: be stale, and a replica that took its own expired shard back still has work of the
        #: old lease in flight until it renews.
        self.held: dict[str, dict[tuple[str, int, int], Lease]] = {name: {} for name in REPLICAS}
        self.written = 0
        self.refused_keys: set[str] = set()
        self.expected_bytes: dict[str, dict[str, bytes]] = {}
        self.payloads: dict[str, bytes] = {}

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    @initialize(lines=st.integers(1, 30), shard_lines=st.integers(1, 7), tenant=st.sampled_from(TENANTS))
    def first_batch(self, lines: int, shard_lines: int, tenant: str) -> None:
        self.add_batch(lines, shard_lines, tenant)

    @rule(lines=st.integers(0, 30), shard_lines=st.integers(1, 7), tenant=st.sampled_from(TENANTS))
    def add_batch(self, lines: int, shard_lines: int, tenant: str) -> None:
        batch_id = f"batch_{len(self.batches)}"
        assert self.run(self.ledger.add_batch(batch_id, lines, shard_lines, tenant=tenant))
        assert not self.run(self.ledger.add_batch(batch_id, lines, shard_lines))  # a second start: nothing
        shards = {shard.shard_no: ShardModel(shard.n_lines) for shard in plan_shards(lines, shard_lines)}
        model = BatchModel(len(self.batches), shards, "running" if shards else "finished", tenant=tenant)
        self.batches[batch_id] = model
        self.expected_bytes[batch_id] = {OUTPUT: b"", ERRORS: b""}

    def _live_leases(self, batch: BatchModel) -> int:
        return sum(shard.live_owner is not None for shard in batch.shards.values())

    def _tenant_live_leases(self, tenant: str) -> int:
        return sum(
            self._live_leases(batch)
            for batch in self.batches.values()
            if batch.tenant == tenant and batch.status == "running"
        )

    def _turn(self, batch_id: str) -> tuple[int, int, int]:
        """Whose turn a claim of one shard serves: the tenant with the fewest live leases, then
        its batch with the fewest, then the oldest."""
        batch = self.batches[batch_id]
        return self._tenant_live_leases(batch.tenant), self._live_leases(batch), batch.created

    @rule(replica=st.sampled_from(REPLICAS), limit=st.integers(1, 3))
    def claim(self, replica: str, limit: int) -> None:
        claimable = {
            (batch_id, number)
            for batch_id, batch in self.batches.items()
            if batch.status == "running"
            for number, shard in batch.shards.items()
            if shard.claimable
        }
        # the batch a single claim must serve: its tenant's turn, then its own, then the oldest
        fair = min((self._turn(batch_id) for batch_id, _ in claimable), default=None)
        leases = self.run(self.ledger.claim(replica, limit, HOUR_S))
        assert len(leases) == min(limit, len(claimable))
        assert {lease.key for lease in leases} <= claimable
        if limit == 1 and leases:
            assert self._turn(leases[0].batch_id) == fair
        self._hold(replica, leases)

    def _hold(self, replica: str, leases: list[Lease]) -> None:
        """Check newly leased shards against the model (the next epoch, the lines done so far)
        and record them as the replica's."""
        for lease in leases:
            shard = self.batches[lease.batch_id].shards[lease.shard.shard_no]
            assert lease.epoch == shard.epoch + 1
            assert lease.done_lines == shard.done_lines
            shard.epoch, shard.owner, shard.expired = lease.epoch, replica, False
            self.held[replica][(*lease.key, lease.epoch)] = lease

    @rule(replica=st.sampled_from(REPLICAS), limit=st.integers(1, 3))
    def take_over(self, replica: str, limit: int) -> None:
        """A replica holding all it may claim takes over only leases that ran out: never a
        pending shard, never a live lease, never a finished batch's."""
        expired = {
            (batch_id, number)
            for batch_id, batch in self.batches.items()
            if batch.status == "running"
            for number, shard in batch.shards.items()
            if not shard.done and shard.owner is not None and shard.expired
        }
        leases = self.run(self.ledger.take_over(replica, limit, HOUR_S))
        assert len(leases) == min(limit, len(expired))
        assert {lease.key for lease in leases} <= expired
        self._hold(replica, leases)

    @rule(replica=st.sampled_from(REPLICAS))
    def expire(self, replica: str) -> None:
        """The replica stops renewing long enough for its leases to run out (the database's
        clock is moved for them: they end a second ago)."""
        self.run(
            self.ledger._rows(
                "UPDATE batch_shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                "WHERE owner_id = %(owner)s AND state = 'leased'",
                {"owner": replica},
            )
        )
        for batch in self.batches.values():
            for shard in batch.shards.values():
                if shard.owner == replica:
                    shard.expired = True

    @rule(replica=st.sampled_from(REPLICAS), limit=st.integers(1, 3))
    def pause_then_claim(self, replica: str, limit: int) -> None:
        """A replica paused past its leases claims again at once, maybe its own shards back at a
        new epoch, while its work under the old leases is still in flight."""
        self.expire(replica)
        self.claim(replica, limit)

    @rule(replica=st.sampled_from(REPLICAS))
    def renew(self, replica: str) -> None:
        kept = self.run(self.ledger.renew(replica, HOUR_S))
        expected = {
            (batch_id, number): shard.epoch
            for batch_id, batch in self.batches.items()
            if batch.status == "running"
            for number, shard in batch.shards.items()
            if shard.live_owner == replica
        }
        assert kept == expected
        # what a replica does with the answer: drop every shard it lost
        self.held[replica] = {
            key: lease for key, lease in self.held[replica].items() if kept.get(lease.key) == lease.epoch
        }

    def _holders(self) -> list[str]:
        return [name for name in REPLICAS if self.held[name]]

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        replica = data.draw(st.sampled_from(self._holders()))
        key = data.draw(st.sampled_from(sorted(self.held[replica])))
        lease = self.held[replica][key]
        batch = self.batches[lease.batch_id]
        shard = batch.shards[lease.shard.shard_no]
        # the lines this holder has not committed itself (a zombie may pick ones others did)
        candidates = [
            line for line in lease.remaining if line not in shard.done_lines or shard.epoch != lease.epoch
        ]
        if not candidates:
            return
        lines = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=4, unique=True))
        failed = data.draw(st.sets(st.sampled_from(lines)))
        parts = []
        for kind, chosen in ((OUTPUT, [x for x in lines if x not in failed]), (ERRORS, sorted(failed))):
            if chosen:
                self.written += 1
                object_key = segment_key(
                    lease.batch_id, kind, lease.shard.shard_no, lease.epoch, self.written
                )
                payload = b"".join(_line_bytes(lease.batch_id, line) for line in chosen)
                size = self.segments.write(object_key, payload)
                self.payloads[object_key] = payload
                failed_lines = len(chosen) if kind == ERRORS else 0
                parts.append(SegmentPart(kind, object_key, size, tuple(chosen), failed_lines=failed_lines))
        current = shard.live_owner == replica and shard.epoch == lease.epoch and batch.status == "running"
        try:
            committed = self.run(self.ledger.commit(lease, parts))
        except CommitRefused:
            event(f"commit refused: {_why_refused(shard, lease, replica, batch.status)}")
            assert not current, "a commit under the shard's current, live lease was refused"
            self.refused_keys.update(part.object_key for part in parts)
            self.held[replica].pop(key)  # a fenced-out replica drops the shard
            return
        event("commit accepted")
        assert current, "a commit under a stale, expired or cancelled lease counted"
        assert [segment.object_key for segment in committed] == [part.object_key for part in parts]
        for part in parts:
            shard.done_lines.update(part.lines)
            self.expected_bytes[lease.batch_id][part.kind] += self.payloads[part.object_key]
            if part.kind == OUTPUT:
                batch.completed += len(part.lines)
            else:
                batch.failed += len(part.lines)
        if shard.done:
            shard.owner = None
            self.held[replica].pop(key)

    @rule(data=st.data(), replica=st.sampled_from(REPLICAS))
    def commit_a_line_twice(self, data: st.DataObject, replica: str) -> None:
        """The shard's current owner commits a line that is committed already: refused whole."""
        current = [
            lease
            for lease in self.held[replica].values()
            if (shard := self.batches[lease.batch_id].shards[lease.shard.shard_no]).done_lines
            and shard.live_owner == replica
            and shard.epoch == lease.epoch
            and self.batches[lease.batch_id].status == "running"
        ]
        if not current:
            return
        lease = data.draw(st.sampled_from(current))
        shard = self.batches[lease.batch_id].shards[lease.shard.shard_no]
        again = data.draw(st.sampled_from(sorted(shard.done_lines)))
        fresh = [line for line in lease.shard.lines if line not in shard.done_lines][:1]
        part = SegmentPart(
            OUTPUT,
            f"segments/{lease.batch_id}/output/x/{time.monotonic_ns()}",
            0,
            (again, *fresh),
            failed_lines=0,
        )
        with pytest.raises(LineCommittedTwice):
            self.run(self.ledger.commit(lease, [part]))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        replica = data.draw(st.sampled_from(self._holders()))
        key = data.draw(st.sampled_from(sorted(self.held[replica])))
        lease = self.held[replica].pop(key)
        shard = self.batches[lease.batch_id].shards[lease.shard.shard_no]
        expected = shard.owner == replica and shard.epoch == lease.epoch and not shard.done
        assert self.run(self.ledger.release(lease)) == expected
        if expected:
            shard.owner, shard.expired = None, False

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted(self.batches)))
        batch = self.batches[batch_id]
        assert self.run(self.ledger.cancel(batch_id)) == (batch.status == "running")
        if batch.status == "running":
            batch.status = "cancelled"

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted(self.batches)))
        batch = self.batches[batch_id]
        expected = batch.status == "running" and all(shard.done for shard in batch.shards.values())
        assert self.run(self.ledger.finish_if_done(batch_id)) == expected
        assert not self.run(self.ledger.finish_if_done(batch_id))  # exactly one caller wins
        if expected:
            batch.status = "finished"

    @invariant()
    def ledger_matches_the_model(self) -> None:
        for batch_id, batch in self.batches.items():
            work = self.run(self.ledger.batch(batch_id))
            assert work is not None
            assert (work.status, work.completed, work.failed) == (batch.status, batch.completed, batch.failed)
            assert work.shards == len(batch.shards)
            assert work.shards_done == sum(shard.done for shard in batch.shards.values())
            holders = self.run(self.ledger.holders(batch_id))
            expected: dict[str, int] = {}
            for shard in batch.shards.values():
                if shard.live_owner is not None:
                    expected[shard.live_owner] = expected.get(shard.live_owner, 0) + 1
            assert holders == expected

    @invariant()
    def only_committed_bytes_are_served_each_line_once(self) -> None:
        for batch_id, expected in self.expected_bytes.items():
            lines: list[bytes] = []
            for kind in (OUTPUT, ERRORS):
                manifest = self.run(self.ledger.segments(batch_id, kind))
                served = b"".join(self.segments.read(manifest))
                assert served == expected[kind]
                lines.extend(served.splitlines())
            assert len(lines) == len(set(lines))
        committed = self.run(self.ledger.committed_keys())
        assert not committed & self.refused_keys
        assert set(self.segments.orphans(committed, self.expected_bytes, grace_s=-60)) == self.refused_keys


@pytest.fixture
def ledger_machine(postgres_url: str, tmp_path: Path) -> Iterator[type[LedgerMachine]]:
    loop = asyncio.new_event_loop()
    try:
        LedgerMachine.loop = loop
        LedgerMachine.shared_ledger = loop.run_until_complete(_ledger(postgres_url))
        LedgerMachine.folder = tmp_path
        yield LedgerMachine
        loop.run_until_complete(LedgerMachine.shared_ledger.close())
    finally:
        loop.close()


def test_leases_fencing_and_the_manifest_hold_in_any_order(ledger_machine: type[LedgerMachine]) -> None:
    run_state_machine_as_test(
        ledger_machine, settings=settings(max_examples=examples(120), stateful_step_count=50)
    )


@pytest.mark.anyio
async def test_concurrent_claims_never_share_a_shard(postgres_url: str) -> None:
    ledgers = [await _ledger(postgres_url) for _ in REPLICAS]
    try:
        await ledgers[0].add_batch("batch_big", 300, shard_lines=5)  # 60 shards
        rounds = await asyncio.gather(
            *(
                ledger.claim(name, 4, HOUR_S)
                for _ in range(6)
                for ledger, name in zip(ledgers, REPLICAS, strict=True)
            )
        )
        keys = [lease.key for leases in rounds for lease in leases]
        assert len(keys) == len(set(keys)) == 60
        assert await ledgers[0].holders("batch_big") == {
            name: sum(len(leases) for leases in rounds if leases and leases[0].owner_id == name)
            for name in REPLICAS
        }
    finally:
        for ledger in ledgers:
            await ledger.close()


@pytest.mark.anyio
async def test_a_lease_runs_out_on_the_database_clock_and_fences_its_old_owner(
    postgres_url: str, tmp_path: Path
) -> None:
    ledger = await _ledger(postgres_url)
    segments = SegmentFiles(tmp_path)
    try:
        await ledger.add_batch("batch_one", 4, shard_lines=4)
        [old] = await ledger.claim("replica-a", 1, ttl_s=0.5)
        assert await ledger.claim("replica-b", 1, HOUR_S) == []  # held, and live
        await asyncio.sleep(0.8)
        assert await ledger.renew("replica-a", HOUR_S) == {}  # ran out: not renewed
        [new] = await ledger.claim("replica-b", 1, HOUR_S)
        assert (new.key, new.epoch) == (old.key, old.epoch + 1)
        key = segment_key("batch_one", OUTPUT, 0, old.epoch, 0)
        zombie = SegmentPart(
            OUTPUT, key, segments.write(key, _line_bytes("batch_one", 0)), (0,), failed_lines=0
        )
        with pytest.raises(CommitRefused):
            await ledger.commit(old, [zombie])
        key = segment_key("batch_one", OUTPUT, 0, new.epoch, 0)
        part = SegmentPart(
            OUTPUT, key, segments.write(key, _line_bytes("batch_one", 0)), (0, 1, 2, 3)[:1], failed_lines=0
        )
        await ledger.commit(new, [part])
        manifest = await ledger.segments("batch_one")
        assert [segment.epoch for segment in manifest] == [new.epoch]
        assert segments.orphans(await ledger.committed_keys(), {"batch_one"}, grace_s=-60) == [
            zombie.object_key
        ]
        assert await collect_orphans(ledger, segments, grace_s=3600) == 0  # too young to go yet
        assert await collect_orphans(ledger, segments, grace_s=-60) == 1
        assert list(segments.keys()) == [part.object_key]
        assert b"".join(segments.read(manifest)) == _line_bytes("batch_one", 0)
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_a_replica_that_took_its_own_shard_back_cannot_commit_under_the_old_lease(
    postgres_url: str, tmp_path: Path
) -> None:
    """Same owner, new epoch: the work still in flight under the expired lease is fenced out."""
    ledger = await _ledger(postgres_url)
    segments = SegmentFiles(tmp_path)
    try:
        await ledger.add_batch("batch_self", 2, shard_lines=2)
        [old] = await ledger.claim("replica-a", 1, ttl_s=0.3)
        await asyncio.sleep(0.5)
        [new] = await ledger.claim("replica-a", 1, HOUR_S)
        assert (new.key, new.owner_id, new.epoch) == (old.key, old.owner_id, old.epoch + 1)
        key = segment_key("batch_self", OUTPUT, 0, old.epoch, 0)
        with pytest.raises(CommitRefused):
            await ledger.commit(
                old, [SegmentPart(OUTPUT, key, segments.write(key, b"x\n"), (0,), failed_lines=0)]
            )
        assert await ledger.segments("batch_self") == []
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_cancel_stops_commits_and_renewals_of_every_holder(postgres_url: str, tmp_path: Path) -> None:
    ledger = await _ledger(postgres_url)
    segments = SegmentFiles(tmp_path)
    try:
        await ledger.add_batch("batch_c", 4, shard_lines=2)
        [a] = await ledger.claim("replica-a", 1, HOUR_S)
        [b] = await ledger.claim("replica-b", 1, HOUR_S)
        assert await ledger.cancel("batch_c")
        assert not await ledger.cancel("batch_c")
        assert await ledger.renew("replica-a", HOUR_S) == {} == await ledger.renew("replica-b", HOUR_S)
        for lease in (a, b):
            key = segment_key("batch_c", OUTPUT, lease.shard.shard_no, lease.epoch, 0)
            part = SegmentPart(
                OUTPUT, key, segments.write(key, b"x\n"), (lease.shard.first_line,), failed_lines=0
            )
            with pytest.raises(CommitRefused):
                await ledger.commit(lease, [part])
        work = await ledger.batch("batch_c")
        assert work is not None
        assert (work.status, work.completed, work.failed) == ("cancelled", 0, 0)
        assert await ledger.claim("replica-c", 2, HOUR_S) == []
    finally:
        await ledger.close()


@pytest.mark.anyio
@pytest.mark.parametrize("ttl_s", [0.0, -1.0, float("nan"), float("inf"), 86_401.0])
async def test_a_lease_length_out_of_bounds_is_refused(postgres_url: str, ttl_s: float) -> None:
    ledger = await _ledger(postgres_url)
    try:
        await ledger.add_batch("batch_t", 2)
        with pytest.raises(ValueError):
            await ledger.claim("replica-a", 1, ttl_s)
        with pytest.raises(ValueError):
            await ledger.renew("replica-a", ttl_s)
        assert await ledger.holders("batch_t") == {}
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_a_postgres_restart_fails_calls_meanwhile_then_serves_again(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    ledger = await _ledger(postgres_url)
    try:
        await ledger.add_batch("batch_r", 10, shard_lines=5)
        [lease] = await ledger.claim("replica-a", 1, HOUR_S)
        await asyncio.to_thread(postgres_server.restart)
        # the pool replaces the connections the crash broke: the lease survived in the database
        assert await ledger.renew("replica-a", HOUR_S) == {lease.key: lease.epoch}
        [other] = await ledger.claim("replica-b", 1, HOUR_S)
        assert other.key != lease.key
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_a_ledger_call_while_postgres_is_down_fails_within_its_timeout() -> None:
    server = await asyncio.to_thread(PostgresServer.start)
    try:
        ledger = PostgresShardLedger(server.url(), connect_timeout_s=2.0)
        await ledger.open()
        await ledger.create_schema()
        await ledger.add_batch("batch_d", 3)
        await asyncio.to_thread(server.stop)
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            await ledger.claim("replica-a", 1, HOUR_S)
        assert time.monotonic() - started < 10
        await ledger.close()
    finally:
        server.stop()
        server.remove()


@pytest.mark.anyio
async def test_tenants_take_turns_before_their_batches_do(postgres_url: str) -> None:
    """One tenant's three batches do not crowd out another's one: claims alternate tenants."""
    ledger = await _ledger(postgres_url)
    try:
        for n in range(3):
            await ledger.add_batch(f"batch_a{n}", 40, shard_lines=10, tenant="tenant-a")
        await ledger.add_batch("batch_b", 40, shard_lines=10, tenant="tenant-b")
        claimed = [lease.batch_id for _ in range(8) for lease in await ledger.claim("replica-a", 1, HOUR_S)]
        assert [batch_id == "batch_b" for batch_id in claimed] == [False, True] * 4 or [
            batch_id == "batch_b" for batch_id in claimed
        ] == [True, False] * 4
        assert set(claimed) == {"batch_a0", "batch_a1", "batch_a2", "batch_b"}
    finally:
        await ledger.close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("heavy", "light", "claims", "expected"), [(3.0, 1.0, 8, 6), (2.0, 1.0, 9, 6), (1.0, 1.0, 8, 4)]
)
async def test_a_tenants_weight_is_its_share_of_the_claims(
    postgres_url: str, heavy: float, light: float, claims: int, expected: int
) -> None:
    """Two tenants with one batch each: claimed one at a time, the shards go in proportion to the
    tenants' weights (leases / weight decides whose turn it is), across every replica's claims."""
    ledger = await _ledger(postgres_url)
    try:
        await ledger.add_batch("batch_heavy", 200, shard_lines=10, tenant="heavy", weight=heavy)
        await ledger.add_batch("batch_light", 200, shard_lines=10, tenant="light", weight=light)
        claimed = [
            lease.batch_id
            for n in range(claims)
            for lease in await ledger.claim(f"replica-{n % 3}", 1, HOUR_S)
        ]
        assert claimed.count("batch_heavy") == expected, claimed
        assert claimed.count("batch_light") == claims - expected
        with pytest.raises(ValueError, match="weight"):
            await ledger.add_batch("batch_free", 10, tenant="x", weight=0)
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_a_heartbeats_renewal_extends_only_the_listed_leases_and_waits_for_no_commit(
    postgres_url: str,
) -> None:
    """``renew_held``: a lease the owner no longer lists is not extended (it runs out); a shard
    whose row a commit holds is answered as busy at once, not waited for and not extended; the
    others are renewed."""
    ledger = await _ledger(postgres_url)
    try:
        await ledger.add_batch("batch_h", 30, shard_lines=10)
        first, second, _unlisted = await ledger.claim("replica-a", 3, 2.0)
        async with (
            await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as heartbeat,
            await psycopg.AsyncConnection.connect(postgres_url) as committing,
        ):
            # a commit in flight: its transaction holds the batch's row and the second shard's
            await committing.execute("SELECT 1 FROM batch_work WHERE batch_id = 'batch_h' FOR NO KEY UPDATE")
            await committing.execute(
                "SELECT 1 FROM batch_shards WHERE batch_id = 'batch_h' AND shard_no = %s FOR UPDATE",
                (second.shard.shard_no,),
            )
            answer = await asyncio.wait_for(renew_held(heartbeat, "replica-a", HOUR_S, [first, second]), 2.0)
            await committing.rollback()
        assert answer.renewed == {first.key: first.epoch}
        assert answer.busy == {second.key: second.epoch}
        await asyncio.sleep(2.1)  # the unlisted lease and the busy one ran out; the renewed did not
        assert await ledger.renew("replica-a", HOUR_S) == {first.key: first.epoch}
    finally:
        await ledger.close()
