"""Shard runners sharing batches on a real PostgreSQL and a shared store: every line exactly once.

In one process: two runners split a batch and commit every line once; a small batch created
behind a large one finishes first; a ``pg_ctl restart -m immediate`` mid-batch; and the S3 store
(SeaweedFS) stopped for 10 s mid-batch, during which a runner reports itself unhealthy. As
processes (``tests.work_replica``): a 300-line batch created behind a 30,000-line one ends first
while the busiest replica is killed three times and then two of the three at once; over a shared
folder and over S3, three replicas, the one
holding the most shards killed with SIGKILL at random moments and restarted, and one paused with
SIGSTOP for twice its lease and then continued (a zombie: it loses its leases and nothing it
finished counts); and one in a network namespace (``tests.netns``) cut off from PostgreSQL for
twice its lease, then healed (a partition: its calls hang rather than fail). Each ends with every line of the batch in exactly one committed output or
error line, and the counters equal to those lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import select
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from batchgen.core.work.postgres_ledger import BatchWork, PostgresShardLedger
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.segment_store import SegmentStore, open_segment_store
from batchgen.core.work.shard_runner import LineResult, ShardRunner
from batchgen.core.work.shards import ERRORS, OUTPUT, Lease, Segment, SegmentPart
from tests.netns import Namespace
from tests.postgres import PostgresServer
from tests.seaweedfs import SeaweedServer
from tests.work_replica import launch, result_line

pytestmark = pytest.mark.live


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _served(
    ledger: PostgresShardLedger, store: SegmentStore, batch_id: str
) -> dict[str, list[dict[str, str]]]:
    """The committed lines of a batch, by kind, as a reader sees them."""
    served = {}
    for kind in (OUTPUT, ERRORS):
        manifest = await ledger.segments(batch_id, kind)
        served[kind] = [json.loads(line) for line in b"".join(store.read(manifest)).splitlines()]
    return served


def _committed_bytes(store: SegmentStore, segment: Segment) -> bytes:
    """One segment's committed bytes, as a reader gets them."""
    return b"".join(store.read([segment]))


def _line(batch_id: str, line: int, owner: str) -> LineResult:
    kind = ERRORS if line % 13 == 0 else OUTPUT
    return result_line(kind, custom_id=f"{batch_id}-{line}", replica=owner)


async def _wait_finished(ledger: PostgresShardLedger, batch_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (work := await ledger.batch(batch_id)) is None or work.status != "finished":
        assert time.monotonic() < deadline, work
        await asyncio.sleep(0.05)


async def _every_line_once(
    ledger: PostgresShardLedger,
    store: SegmentStore,
    runners: list[ShardRunner],
    tasks: list[asyncio.Task[None]],
    batch_id: str,
    lines: int,
) -> tuple[dict[str, list[dict[str, str]]], BatchWork]:
    """Wait for the batch to finish, stop the runners, and check that each of its lines has
    exactly one committed output or error line and that the counters equal them."""
    await _wait_finished(ledger, batch_id, 120)
    for runner in runners:
        runner.stop()
    await asyncio.gather(*tasks)
    served = await _served(ledger, store, batch_id)
    work = await ledger.batch(batch_id)
    ids = Counter(line["custom_id"] for kind in served.values() for line in kind)
    assert ids == Counter(f"{batch_id}-{n}" for n in range(lines))
    assert work is not None
    assert (work.completed, work.failed) == (len(served[OUTPUT]), len(served[ERRORS]))
    return served, work


@pytest.mark.anyio
async def test_two_runners_split_a_batch_and_commit_every_line_once(
    postgres_url: str, tmp_path: Path
) -> None:
    store = SegmentFiles(tmp_path)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_split", 400, shard_lines=20)
        runners = []
        for owner in ("replica-a", "replica-b"):

            async def run_line(batch_id: str, line: int, owner: str = owner) -> LineResult:
                await asyncio.sleep(random.uniform(0, 0.01))
                return _line(batch_id, line, owner)

            runners.append(
                ShardRunner(ledger, store, run_line, replica_id=owner, max_shards=2, commit_interval_s=0.05)
            )
        tasks = [asyncio.create_task(runner.run()) for runner in runners]
        served, work = await _every_line_once(ledger, store, runners, tasks, "batch_split", 400)
    assert (work.completed, work.failed) == (369, 31)
    assert {line["replica"] for lines in served.values() for line in lines} == {"replica-a", "replica-b"}
    assert sum(runner.lines_committed for runner in runners) == 400


@pytest.mark.anyio
async def test_a_small_batch_behind_a_large_one_finishes_first(postgres_url: str, tmp_path: Path) -> None:
    store = SegmentFiles(tmp_path)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_large", 2000, shard_lines=20)
        await ledger.add_batch("batch_small", 60, shard_lines=20)

        async def run_line(batch_id: str, line: int) -> LineResult:
            await asyncio.sleep(0.005)
            return _line(batch_id, line, "replica-a")

        runner = ShardRunner(
            ledger, store, run_line, replica_id="replica-a", max_shards=2, commit_interval_s=0.05
        )
        task = asyncio.create_task(runner.run())
        await _wait_finished(ledger, "batch_small", 60)
        large = await ledger.batch("batch_large")
        runner.stop()
        await task
    assert large is not None
    assert large.status == "running"
    assert large.completed + large.failed < 2000 / 2


@pytest.mark.anyio
async def test_a_cancel_on_a_replica_running_none_of_the_batch_stops_it_everywhere_within_2_s(
    postgres_url: str, tmp_path: Path
) -> None:
    """Two runners share a batch of long lines (none finishes, so no commit can be refused); a
    third replica's ledger, which runs none of it, cancels it. With the default lease (renewals
    every 3.3 s), both runners still drop its shards within 2 s, their lines in flight are
    cancelled, and none starts after that."""
    store = SegmentFiles(tmp_path)
    started: list[float] = []
    stopped_lines: list[float] = []
    async with PostgresShardLedger(postgres_url) as ledger, PostgresShardLedger(postgres_url) as elsewhere:
        await ledger.create_schema()
        await ledger.add_batch("batch_stop", 4000, shard_lines=100)

        async def run_line(batch_id: str, line: int) -> LineResult:
            started.append(time.monotonic())
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                stopped_lines.append(time.monotonic())
                raise
            return _line(batch_id, line, "replica")

        runners = [
            ShardRunner(ledger, store, run_line, replica_id=name, max_shards=2, concurrency=8)
            for name in ("replica-a", "replica-b")
        ]
        assert runners[0].ttl_s / 3 > 3  # only the watch can stop the batch in time
        tasks = [asyncio.create_task(runner.run()) for runner in runners]
        deadline = time.monotonic() + 30
        while not all(runner.held for runner in runners) or len(started) < 16:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        cancelled_at = time.monotonic()
        assert await elsewhere.cancel("batch_stop")
        while any(runner.held for runner in runners) or len(stopped_lines) < 16:
            assert time.monotonic() - cancelled_at < 2.0, [runner.held for runner in runners]
            await asyncio.sleep(0.02)
        stopped_by = time.monotonic()
        await asyncio.sleep(0.5)
        assert [t for t in started if t > cancelled_at] == []
        assert sum(runner.shards_cancelled for runner in runners) >= 2
        assert sum(runner.leases_lost + runner.commits_refused for runner in runners) == 0
        assert max(stopped_lines) <= stopped_by
        for runner in runners:
            runner.stop()
        await asyncio.gather(*tasks)
        work = await ledger.batch("batch_stop")
    assert work is not None and work.status == "cancelled" and work.completed + work.failed == 0


class _CuttableLink:
    """A TCP relay to PostgreSQL in a thread of its own, which ``cut`` stops relaying (bytes are
    held, connections stay open: a partition as a client sees it, calls that never answer) until
    ``heal``. Every connection to ``url`` goes through it, the ledger's pool and the heartbeat's."""

    def __init__(self, postgres_url: str) -> None:
        self.target = ("127.0.0.1", int(postgres_url.rsplit(":", 1)[1].split("/", 1)[0]))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = postgres_url.replace(f":{self.target[1]}/", f":{self.listener.getsockname()[1]}/")
        self.relaying = threading.Event()
        self.relaying.set()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.relaying.clear()

    def heal(self) -> None:
        self.relaying.set()

    def close(self) -> None:
        self.closed = True
        self.relaying.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._relay, args=(source, sink), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self.closed:
                self.relaying.wait()
                if not select.select([source], [], [], 0.05)[0] or not self.relaying.is_set():
                    continue
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


@pytest.mark.anyio
async def test_a_runner_whose_calls_hang_lets_its_shards_go_when_their_lease_runs_out(
    postgres_url: str, tmp_path: Path
) -> None:
    """Self-fencing: with every call unanswered (its connections to PostgreSQL cut, the
    heartbeat's too), the runner gives each call up after a third of the lease, reports the ledger unhealthy, and once a whole lease has passed since the last
    renewal it sent that was answered, drops its shards: no line of theirs starts after that.
    Once calls answer again it takes the work up again and the batch ends with each line once."""
    store = SegmentFiles(tmp_path)
    ttl_s = 1.5
    started: list[float] = []
    link = _CuttableLink(postgres_url)
    async with PostgresShardLedger(postgres_url) as ledger, PostgresShardLedger(link.url) as linked:
        await ledger.create_schema()
        await ledger.add_batch("batch_hang", 600, shard_lines=200)

        async def run_line(batch_id: str, line: int) -> LineResult:
            started.append(time.monotonic())
            await asyncio.sleep(0.05)
            return _line(batch_id, line, "replica-a")

        runner = ShardRunner(
            linked,
            store,
            run_line,
            replica_id="replica-a",
            max_shards=2,
            concurrency=4,
            ttl_s=ttl_s,
            commit_interval_s=0.05,
        )
        task = asyncio.create_task(runner.run())
        while len(started) < 20:
            await asyncio.sleep(0.01)
        cut_at = time.monotonic()
        link.cut()
        # the last answered renewal was sent at most a third of the lease before the cut; the
        # drop comes at the first heartbeat after the lease from then has passed
        await asyncio.sleep(ttl_s + 2 * ttl_s / 3 + 0.3)
        assert runner.held == [] and runner.leases_lost >= 1
        # two renewals in a row given up: the first by a third of a lease after the cut, the
        # next (sent at once) a third later
        deadline = time.monotonic() + 10 * ttl_s
        while not any(problem.startswith("ledger renewals") for problem in runner.problems):
            assert time.monotonic() < deadline, runner.problems
            await asyncio.sleep(0.05)
        dropped_by = time.monotonic()
        await asyncio.sleep(1.0)
        assert [t for t in started if t > dropped_by] == []  # nothing of the dropped shards ran on
        assert [t for t in started if t > cut_at + ttl_s + 2 * ttl_s / 3 + 0.2] == []
        link.heal()
        await _wait_finished(ledger, "batch_hang", 120)
        assert runner.healthy
        runner.stop()
        await task
        served = await _served(ledger, store, "batch_hang")
    link.close()
    ids = Counter(line["custom_id"] for kind in served.values() for line in kind)
    assert ids == Counter(f"batch_hang-{n}" for n in range(600))


def _slow_runners(
    ledger: PostgresShardLedger, store: SegmentStore, ttl_s: float
) -> tuple[list[ShardRunner], list[asyncio.Task[None]]]:
    """Two running runners whose lines take 50 ms, four at a time each: a batch of a thousand
    lines or so lasts several seconds, time for a fault in the middle."""

    async def run_line(batch_id: str, line: int) -> LineResult:
        await asyncio.sleep(0.05)
        return _line(batch_id, line, "replica")

    runners = [
        ShardRunner(
            ledger,
            store,
            run_line,
            replica_id=name,
            max_shards=2,
            concurrency=4,
            ttl_s=ttl_s,
            commit_interval_s=0.05,
        )
        for name in ("replica-a", "replica-b")
    ]
    return runners, [asyncio.create_task(runner.run()) for runner in runners]


async def _wait_for_lines(ledger: PostgresShardLedger, batch_id: str, lines: int) -> None:
    deadline = time.monotonic() + 60
    while (work := await ledger.batch(batch_id)) is not None and work.completed + work.failed < lines:
        assert time.monotonic() < deadline, work
        await asyncio.sleep(0.05)


class _RefusingClaims(PostgresShardLedger):
    """A ledger whose first ``refusals`` claims fail at once (a database dropping calls), noting
    the runner's ``problems`` as each claim arrives (what the claims before it left)."""

    refusals = 0
    runner: ShardRunner | None = None

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.problems_at_claim: list[list[str]] = []

    async def claim(self, owner_id: str, limit: int, ttl_s: float) -> list[Lease]:
        assert self.runner is not None
        self.problems_at_claim.append(self.runner.problems)
        if len(self.problems_at_claim) <= self.refusals:
            raise ConnectionError("claim dropped by the test")
        return await super().claim(owner_id, limit, ttl_s)


@pytest.mark.anyio
@pytest.mark.parametrize("refusals", [1, 2, 4])
async def test_a_ledger_part_is_a_problem_once_two_of_its_calls_in_a_row_have_failed(
    postgres_url: str, tmp_path: Path, refusals: int
) -> None:
    """One failed claim followed by an answered one leaves the runner healthy (a call given up
    on a loaded machine is not an outage); from the second failure in a row the runner names
    ``ledger claims`` as its problem, until a claim is answered again. The batch ends with each
    line once."""
    store = SegmentFiles(tmp_path)
    batch_id = f"batch_refused_{refusals}"
    async with PostgresShardLedger(postgres_url) as ledger, _RefusingClaims(postgres_url) as refusing:
        await ledger.create_schema()
        await ledger.add_batch(batch_id, 40, shard_lines=20)

        async def run_line(batch_id: str, line: int) -> LineResult:
            return _line(batch_id, line, "replica-a")

        runner = ShardRunner(
            refusing,
            store,
            run_line,
            replica_id="replica-a",
            max_shards=2,
            poll_s=0.05,
            commit_interval_s=0.05,
        )
        refusing.runner, refusing.refusals = runner, refusals
        task = asyncio.create_task(runner.run())
        await _every_line_once(ledger, store, [runner], [task], batch_id, 40)
    claims = refusing.problems_at_claim
    assert len(claims) > refusals
    problem = "ledger claims: ConnectionError: claim dropped by the test"
    # claim k (from 1) sees the failures of claims 1..k-1 in a row
    expected = [[problem] if 2 <= k - 1 <= refusals else [] for k in range(1, refusals + 2)]
    assert claims[: refusals + 1] == expected
    assert runner.healthy


class _LateAnswers(PostgresShardLedger):
    """A ledger whose commit, once ``hold`` is set, is taken by the database and then answers
    only once ``answer`` is set: a replica that reads a commit's answer late (paused, its loop
    busy). ``landed`` is set when the held commit is in the database."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.hold = False
        self.landed = asyncio.Event()
        self.answer = asyncio.Event()

    async def commit(
        self, lease: Lease, parts: Sequence[SegmentPart], *, renew_s: float | None = None
    ) -> list[Segment]:
        segments = await super().commit(lease, parts, renew_s=renew_s)
        if self.hold and not self.landed.is_set():
            self.landed.set()
            await self.answer.wait()
        return segments


@pytest.mark.anyio
@pytest.mark.parametrize("drop", ["batch cancelled", "runner suspended", "runner stopped"])
async def test_a_commit_taken_as_its_shard_is_dropped_still_counts_once_its_answer_comes(
    postgres_url: str, tmp_path: Path, drop: str
) -> None:
    """The database takes a commit, and before the runner reads its answer the shard is dropped
    (its batch cancelled, the runner suspended or stopped): once the answer comes, the runner's
    ``lines_committed`` equals the lines the ledger holds, none lost and none twice."""
    store = SegmentFiles(tmp_path)
    batch_id = f"batch_late_{drop.split()[1]}"
    async with PostgresShardLedger(postgres_url) as ledger, _LateAnswers(postgres_url) as late:
        await ledger.create_schema()
        await ledger.add_batch(batch_id, 200, shard_lines=100)

        async def run_line(batch_id: str, line: int) -> LineResult:
            await asyncio.sleep(0.01)
            return _line(batch_id, line, "replica-a")

        runner = ShardRunner(
            late,
            store,
            run_line,
            replica_id="replica-a",
            max_shards=1,
            concurrency=4,
            commit_lines=10,
            commit_interval_s=0.05,
            watch_s=0.05,
        )
        task = asyncio.create_task(runner.run())
        await _wait_for_lines(ledger, batch_id, 20)
        late.hold = True
        await asyncio.wait_for(late.landed.wait(), 30)
        if drop == "batch cancelled":
            assert await ledger.cancel(batch_id)
        elif drop == "runner suspended":
            runner.suspend("test", "suspended by the test")
        else:
            runner.stop()
        deadline = time.monotonic() + 30
        while runner.held:  # dropped while its commit waits for its answer
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        late.answer.set()
        work = await ledger.batch(batch_id)
        assert work is not None
        while runner.lines_committed < work.completed + work.failed:
            assert time.monotonic() < deadline, (runner.lines_committed, work)
            await asyncio.sleep(0.02)
        runner.stop()
        await task
        work = await ledger.batch(batch_id)
        assert work is not None
        assert runner.lines_committed == work.completed + work.failed > 0


class _GatedAnswers(PostgresShardLedger):
    """A ledger whose first claim (``gated`` "claim") or first watch of stopped batches
    ("stopped") gets its answer from the database, sets ``asked``, and returns once ``gate`` is
    set: the test can cancel the runner in the very turn of the loop the answer comes in."""

    def __init__(self, url: str, gated: str) -> None:
        super().__init__(url)
        self.gated = gated
        self.asked = asyncio.Event()
        self.gate = asyncio.Event()

    async def _held(self) -> None:
        if not self.asked.is_set():
            self.asked.set()
            await self.gate.wait()

    async def claim(self, owner_id: str, limit: int, ttl_s: float) -> list[Lease]:
        leases = await super().claim(owner_id, limit, ttl_s)
        if self.gated == "claim":
            await self._held()
        return leases

    async def stopped(self, batch_ids: Sequence[str]) -> set[str]:
        stopped = await super().stopped(batch_ids)
        if self.gated == "stopped":
            await self._held()
        return stopped


@pytest.mark.anyio
@pytest.mark.parametrize("gated", ["claim", "stopped"])
async def test_a_runner_cancelled_as_a_ledger_call_answers_ends(
    postgres_url: str, tmp_path: Path, gated: str
) -> None:
    """A runner's task cancelled in the turn of the loop in which a claim (or its watch of
    stopped batches) answers ends, its shards let go: the cancel is not lost (asyncio.wait_for
    on Python 3.11 returns the answer instead, and the runner then ran on for ever, as a test's
    event loop closing at its end found)."""
    store = SegmentFiles(tmp_path)
    batch_id = f"batch_gated_{gated}"
    async with (
        PostgresShardLedger(postgres_url) as ledger,
        _GatedAnswers(postgres_url, gated) as gated_ledger,
    ):
        await ledger.create_schema()
        await ledger.add_batch(batch_id, 4, shard_lines=2)

        async def run_line(batch_id: str, line: int) -> LineResult:
            await asyncio.Event().wait()  # never ends: the shard stays held
            raise AssertionError("unreachable")

        runner = ShardRunner(
            gated_ledger, store, run_line, replica_id="replica-a", max_shards=1, watch_s=0.05
        )
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(gated_ledger.asked.wait(), 30)
        gated_ledger.gate.set()
        task.cancel()
        done, _ = await asyncio.wait((task,), timeout=30)
        if not done:  # the cancel was lost: stop the runner the other way before failing
            runner.stop()
            await asyncio.wait((task,), timeout=30)
        assert task in done and task.cancelled()
        assert runner.held == []
        if gated == "stopped":  # the shard it ran is released on the way out (a claim answered
            # as the runner stops is not taken in: those leases run out, as a dead replica's)
            assert await ledger.holders(batch_id) == {}


@pytest.mark.anyio
async def test_runners_ride_out_a_postgres_restart_and_commit_every_line_once(
    postgres_server: PostgresServer, postgres_url: str, tmp_path: Path
) -> None:
    store = SegmentFiles(tmp_path)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_restart", 1500, shard_lines=25)

        runners, tasks = _slow_runners(ledger, store, ttl_s=3.0)
        await _wait_for_lines(ledger, "batch_restart", 300)
        await asyncio.to_thread(postgres_server.restart)  # -m immediate: every connection breaks
        during = await ledger.batch("batch_restart")
        assert during is not None
        assert during.status == "running"  # the restart came mid-batch
        await _every_line_once(ledger, store, runners, tasks, "batch_restart", 1500)


@pytest.mark.anyio
async def test_runners_wait_out_the_object_store_down_for_10_s_and_commit_every_line_once(
    seaweed_server: SeaweedServer, postgres_url: str
) -> None:
    store = open_segment_store(seaweed_server.url(f"outage-{time.time_ns()}"), seaweed_server.environ)
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_outage", 1200, shard_lines=25)

        runners, tasks = _slow_runners(ledger, store, ttl_s=30.0)
        await _wait_for_lines(ledger, "batch_outage", 200)
        await asyncio.to_thread(seaweed_server.stop)
        try:
            down_until = time.monotonic() + 10
            unhealthy = False
            while time.monotonic() < down_until:
                unhealthy = unhealthy or any(not runner.healthy for runner in runners)
                await asyncio.sleep(0.1)
            during = await ledger.batch("batch_outage")
        finally:
            await asyncio.to_thread(seaweed_server.run)
        assert during is not None
        assert during.status == "running"  # the outage came mid-batch
        assert unhealthy, "no runner noticed the store was down"
        await _every_line_once(ledger, store, runners, tasks, "batch_outage", 1200)
    assert all(runner.healthy for runner in runners), [runner.problems for runner in runners]


class _Replicas:
    """``tests.work_replica`` processes, started and signalled by name."""

    def __init__(
        self,
        url: str,
        blob_url: str,
        environ: dict[str, str],
        logs: Path,
        ttl_s: float,
        *,
        concurrency: int = 8,
    ) -> None:
        self.url, self.blob_url, self.environ, self.logs, self.ttl_s = url, blob_url, environ, logs, ttl_s
        self.concurrency = concurrency
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.starts = Counter[str]()
        #: Each replica's ledger owner id in its current run.
        self.owner_ids: dict[str, str] = {}

    def start(self, owner: str, *, url: str | None = None, inside: Namespace | None = None) -> None:
        """Start ``owner`` (over ``url`` instead of the group's, and ``inside`` a namespace if given)."""
        self.starts[owner] += 1
        options = ["--ttl-s", str(self.ttl_s), "--line-s", "0.05", "--concurrency", str(self.concurrency)]
        self.processes[owner], self.owner_ids[owner] = launch(
            url or self.url,
            self.blob_url,
            owner,
            self.logs / f"{owner}-{self.starts[owner]}.log",
            [*options, "--max-shards", "3"],
            prefix=inside.command() if inside is not None else (),
            environ=self.environ,
        )

    def signal(self, owner: str, number: int) -> None:
        self.processes[owner].send_signal(number)

    def stop(self, owner: str) -> dict[str, int]:
        """SIGTERM, and the replica's last words: its leases lost and commits refused."""
        process = self.processes[owner]
        process.terminate()
        process.wait(timeout=30)
        log = self.logs / f"{owner}-{self.starts[owner]}.log"
        stats: dict[str, int] = json.loads(log.read_text().splitlines()[-1])
        return stats

    def kill(self, owner: str) -> None:
        process = self.processes[owner]
        process.kill()
        process.wait(timeout=30)

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(params=["files", "s3"])
def replicas(request: pytest.FixtureRequest, postgres_url: str, tmp_path: Path) -> Iterator[_Replicas]:
    """Three replica processes' launcher, over a shared folder or a SeaweedFS bucket."""
    logs = tmp_path / "logs"
    logs.mkdir()
    if request.param == "files":
        blob_url, environ = (tmp_path / "shared").as_uri(), {}
    else:
        server: SeaweedServer = request.getfixturevalue("seaweed_server")
        blob_url, environ = server.url(f"runner-{time.time_ns()}"), server.environ
    group = _Replicas(postgres_url, blob_url, environ, logs, ttl_s=2.0)
    yield group
    group.stop_all()


async def _busiest(
    ledger: PostgresShardLedger, replicas: _Replicas, batch_id: str, timeout_s: float = 60
) -> str:
    """The running replica holding the most live shards of the batch (a dead run's leases, which
    live on until they run out, do not count)."""
    deadline = time.monotonic() + timeout_s
    while True:
        holders = await ledger.holders(batch_id)
        running = {name: holders.get(owner, 0) for name, owner in replicas.owner_ids.items()}
        if any(running.values()):
            return max(running, key=lambda name: running[name])
        assert time.monotonic() < deadline, "no running replica holds a shard"
        await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_replicas_killed_and_paused_still_give_every_line_exactly_once(
    replicas: _Replicas, postgres_url: str
) -> None:
    lines = 9000
    rng = random.Random()
    async with PostgresShardLedger(postgres_url) as ledger:
        await ledger.create_schema()
        await ledger.add_batch("batch_faults", lines, shard_lines=50)
        for owner in ("replica-a", "replica-b", "replica-c"):
            replicas.start(owner)
        for _ in range(3):  # kill -9 the busiest replica at a random moment, then restart it
            await asyncio.sleep(rng.uniform(0.5, 2.5))
            victim = await _busiest(ledger, replicas, "batch_faults")
            replicas.kill(victim)
            replicas.start(victim)
        # a zombie: paused past twice its lease while the others take its shards over, then woken
        zombie = await _busiest(ledger, replicas, "batch_faults")
        replicas.signal(zombie, signal.SIGSTOP)
        await asyncio.sleep(2 * replicas.ttl_s + 1)
        assert replicas.owner_ids[zombie] not in await ledger.holders("batch_faults")
        replicas.signal(zombie, signal.SIGCONT)
        await _wait_finished(ledger, "batch_faults", 300)
        stats = replicas.stop(zombie)
        work = await ledger.batch("batch_faults")
        served = await _served(
            ledger, open_segment_store(replicas.blob_url, replicas.environ), "batch_faults"
        )
    ids = Counter(line["custom_id"] for kind in served.values() for line in kind)
    assert ids == Counter(f"batch_faults-{n}" for n in range(lines))  # exactly once each
    assert work is not None
    assert (work.completed, work.failed) == (len(served[OUTPUT]), len(served[ERRORS]))
    assert work.failed == len(range(0, lines, 17))
    # the zombie woke up holding leases the others had taken: it lost them (at its first renewal,
    # or when its first commit was refused), and none of what it finished after its pause counts
    assert stats["leases_lost"] + stats["commits_refused"] >= 1, stats


@pytest.mark.anyio
async def test_a_small_batch_behind_a_large_one_ends_first_through_kills_and_each_line_is_once(
    postgres_url: str, tmp_path: Path
) -> None:
    """Three replica processes share a 30,000-line batch and a 300-line one created behind it;
    the busiest is killed with SIGKILL three times at random moments (restarted each time), then
    two of the three at once. Every line of both has exactly one committed line, the counters
    equal them, and the small batch ends while the large one still runs. Every segment is
    hashed as soon as it is committed, and is unchanged at the end."""
    (tmp_path / "logs").mkdir()
    group = _Replicas(
        postgres_url, (tmp_path / "shared").as_uri(), {}, tmp_path / "logs", ttl_s=2.0, concurrency=32
    )
    rng = random.Random()
    large, small = 30_000, 300
    store = open_segment_store(group.blob_url)
    hashes: dict[str, str] = {}

    async def hash_committed(ledger: PostgresShardLedger) -> None:
        """Hash every segment once it is committed (its committed bytes, as a reader gets them)."""
        while True:
            for segment in await ledger.segments("batch_large"):
                if segment.object_key not in hashes:
                    data = await asyncio.to_thread(_committed_bytes, store, segment)
                    hashes[segment.object_key] = hashlib.sha256(data).hexdigest()
            await asyncio.sleep(0.3)

    try:
        async with PostgresShardLedger(postgres_url) as ledger:
            await ledger.create_schema()
            await ledger.add_batch("batch_large", large, shard_lines=100)
            watcher = asyncio.create_task(hash_committed(ledger))
            for owner in ("replica-a", "replica-b", "replica-c"):
                group.start(owner)
            await _wait_for_lines(ledger, "batch_large", 500)
            await ledger.add_batch("batch_small", small, shard_lines=100)
            for _ in range(3):
                await asyncio.sleep(rng.uniform(0.2, 1.5))
                victim = await _busiest(ledger, group, "batch_large")
                group.kill(victim)
                group.start(victim)
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            pair = rng.sample(sorted(group.owner_ids), 2)
            for victim in pair:  # two of the three at once
                group.kill(victim)
            for victim in pair:
                group.start(victim)
            await _wait_finished(ledger, "batch_small", 120)
            still = await ledger.batch("batch_large")
            assert still is not None and still.status == "running", "the large batch ended first"
            await _wait_finished(ledger, "batch_large", 300)
            watcher.cancel()
            # committed bytes never change: each segment hashed while the run went on is the same
            segments = {segment.object_key: segment for segment in await ledger.segments("batch_large")}
            assert len(hashes) > 10 and set(hashes) <= set(segments)
            for key, digest in hashes.items():
                assert hashlib.sha256(_committed_bytes(store, segments[key])).hexdigest() == digest, key
            for batch_id, lines in (("batch_large", large), ("batch_small", small)):
                served = await _served(ledger, store, batch_id)
                work = await ledger.batch(batch_id)
                ids = Counter(line["custom_id"] for kind in served.values() for line in kind)
                assert ids == Counter(f"{batch_id}-{n}" for n in range(lines)), batch_id
                assert work is not None
                assert (work.completed, work.failed) == (len(served[OUTPUT]), len(served[ERRORS]))
        assert sum(group.starts.values()) == 3 + 3 + 2
    finally:
        group.stop_all()


@pytest.mark.anyio
async def test_a_replica_cut_off_from_postgres_past_its_lease_loses_its_shards_and_no_line_doubles(
    tmp_path: Path,
) -> None:
    """Partition: one replica runs in a network namespace, reaching PostgreSQL over a veth pair
    that is cut (packets dropped, connections hang) for twice its lease while it holds shards,
    then healed. The others take its shards over; it counts them lost on its own clock, and the
    batch ends with every line exactly once."""
    namespace = await asyncio.to_thread(Namespace.create)
    server = await asyncio.to_thread(PostgresServer.start, also_listen=(namespace.host_ip,))
    group: _Replicas | None = None
    try:
        url = server.new_database()
        (tmp_path / "logs").mkdir()
        group = _Replicas(url, (tmp_path / "shared").as_uri(), {}, tmp_path / "logs", ttl_s=2.0)
        lines = 6000
        async with PostgresShardLedger(url) as ledger:
            await ledger.create_schema()
            await ledger.add_batch("batch_cut", lines, shard_lines=50)
            group.start("replica-a")
            group.start("replica-b")
            cut_url = server.url(url.rsplit("/", 1)[1], host=namespace.host_ip)
            group.start("replica-cut", url=cut_url, inside=namespace)
            deadline = time.monotonic() + 60
            while group.owner_ids["replica-cut"] not in await ledger.holders("batch_cut"):
                assert time.monotonic() < deadline, "the replica in the namespace never held a shard"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(namespace.cut)
            await asyncio.sleep(2 * group.ttl_s + 1)
            assert group.owner_ids["replica-cut"] not in await ledger.holders("batch_cut")
            work = await ledger.batch("batch_cut")
            assert work is not None and work.completed + work.failed < lines, "the batch ended during the cut"
            await asyncio.to_thread(namespace.heal)
            await _wait_finished(ledger, "batch_cut", 300)
            stats = group.stop("replica-cut")
            work = await ledger.batch("batch_cut")
            served = await _served(ledger, open_segment_store(group.blob_url), "batch_cut")
        ids = Counter(line["custom_id"] for kind in served.values() for line in kind)
        assert ids == Counter(f"batch_cut-{n}" for n in range(lines))
        assert work is not None and (work.completed, work.failed) == (
            len(served[OUTPUT]),
            len(served[ERRORS]),
        )
        assert stats["leases_lost"] >= 1, stats
    finally:
        if group is not None:
            group.stop_all()
        server.stop()
        server.remove()
        namespace.remove()
