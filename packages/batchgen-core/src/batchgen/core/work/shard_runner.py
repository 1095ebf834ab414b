"""ShardRunner: one replica's share of the work: claim shards, run their lines, commit, renew, let go.

The loop a replica runs beside its API, over a ``PostgresShardLedger`` and a segment store
(``SegmentFiles`` or ``S3Segments``):

- **claim** up to ``max_shards`` shards whenever it holds fewer (at once when a held shard ends,
  and every ``poll_s`` while there is nothing to claim), and, holding that many, **take over** up to ``max_taken_over`` more
  whose leases ran out unrenewed (a dead replica's), so its work starts again one lease after
  the death, not once a shard held here ends;
- **run** each leased shard's remaining lines through ``run_line``, at most ``concurrency`` at once
  over all shards, a free slot going to the shard with the fewest lines running
  (``shard_slots.ShardSlots``), buffering the finished lines;
- **commit** a shard's buffer as one output and one error segment every ``commit_lines`` lines or
  ``commit_interval_s`` seconds, and when the shard's last line is done: segment files first
  (durable), then the fenced commit, which renews the lease too; a refused commit (the lease was
  lost) drops the shard at once;
- **renew** every lease each ``ttl_s / 3`` seconds, from a thread of its own with a connection
  of its own (``lease_heartbeat.LeaseHeartbeat``), so the thousands of lines on the event loop
  cannot make a renewal late; the loop reads each renewal's answer when it gets to it: a shard
  missing from it (expired, taken over, its batch cancelled) is dropped: its running lines are
  cancelled and its buffer discarded (another replica runs those lines again; they were never
  committed, so no line appears twice), unless its last lines are being committed (a commit
  that ends a shard takes it out of the renewals too: that commit's fence says whether it was
  still the shard's); a commit already on its way is not cut off: its answer is read for up to
  ``call_timeout_s`` more, and lines the database took count in ``lines_committed``;
- **watch** the batches it runs every ``watch_s`` seconds: a batch cancelled anywhere (on any
  replica) has its shards dropped at once, well before the next renewal would drop them;
- after a shard's last commit, ``finish_if_done`` marks its batch finished (one replica wins);
- ``stop`` cancels the work and releases the unfinished leases, so others take them at once.

Each start of a runner is a new owner in the ledger (``owner_id``: the replica id and a token).
``healthy`` is false while the ledger (its claims, or its renewals) or the segment store fails
(``problems`` says how), and true again once the failing part has worked. A part fails when
``FAILURES_REPORTED`` of its calls in a row have failed: a single call given up on a loaded
machine, followed by one that is answered, is not an outage (a timed-out renewal is sent again
at once, a claim after ``poll_s``, a commit at the next commit).

A replica that cannot renew (paused, cut off from the database) fences itself: every ledger call
it makes gives up after a third of the lease (``call_timeout_s``: a partition makes calls hang, not
fail; a claim after a whole lease, ``claim_timeout_s``, since a late claim costs nothing held), and a shard whose lease has not been renewed for a whole lease, counted on this replica's
clock from when the last renewal that was answered was sent (read in the heartbeat's thread), is
dropped as lost. The database has given it away by then (its clock started later), so the replica
stops spending work on lines that are no longer its own; and should it try, every commit after
the lease ended is refused by the fence: output stays exactly once. The heartbeat renews only
while this loop takes its renewals in, so a loop blocked for less than a lease loses nothing, and
one blocked for longer lets its leases run out as a dead replica's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs

from batchgen.core.requests.line_outcomes import LineOutcome, line_outcome
from batchgen.core.work.answer_within import answer_within, read_outcome
from batchgen.core.work.lease_heartbeat import LeaseHeartbeat, Renewal
from batchgen.core.work.postgres_ledger import (
    CommitRefused,
    LineCommittedTwice,
    PostgresShardLedger,
)
from batchgen.core.work.segment_store import SegmentStore, segment_key
from batchgen.core.work.shard_slots import ShardSlots
from batchgen.core.work.shards import DEFAULT_LEASE_S, MAX_LEASE_S, SEGMENT_KINDS, Lease, SegmentPart

__all__ = ["DEFAULT_LEASE_S", "ORPHAN_GRACE_S", "LineResult", "ShardRunner", "collect_orphans"]

logger = logging.getLogger(__name__)

#: How old an uncommitted segment must be before ``collect_orphans`` deletes it: far longer than a
#: write takes to be committed, so only the segments of writers that died or were fenced out go.
ORPHAN_GRACE_S = 3600.0
#: How often a cause that keeps making shards be given up is logged again, with its count.
GIVE_UP_LOG_EVERY_S = 60.0
#: How many calls in a row of one part (claims, renewals, commits) must fail before the runner
#: reports it as a problem.
FAILURES_REPORTED = 2


@attrs.define
class _Failing:
    """A part whose last calls failed: how many in a row, and what the last one raised."""

    calls: int
    detail: str


@attrs.frozen
class LineResult:
    """What one input line produced, as the JSONL bytes to store (one line, ending in a newline),
    and the segments it goes to: the output (``OUTPUT``) or, error lines kept apart, the errors
    (``ERRORS``). Whether it counts as completed or failed is what the line itself records
    (``outcome``), as in one process, not where it is kept."""

    kind: str
    data: bytes
    #: The tokens of the answer (an output line's ``usage``; none for an error line), and of its
    #: prompt those the engine's prefix cache served: added to the batch's ``usage`` on commit.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_cached_tokens: int = 0

    @property
    def outcome(self) -> LineOutcome:
        """Completed or failed, by the rule every count uses (``requests.line_outcomes``)."""
        return line_outcome(self.data)


#: Runs line ``line`` of batch ``batch_id`` and says what it produced.
LineFunction = Callable[[str, int], Awaitable[LineResult]]


@attrs.define
class _HeldShard:
    lease: Lease
    task: asyncio.Task[None] | None = None
    #: Its lines not yet ended: cancelled with the shard at once, even while its task is stuck in
    #: a call that is slow to give up (a commit hanging on a cut connection).
    lines: set[asyncio.Task[tuple[int, LineResult]]] = attrs.field(factory=set)
    buffer: list[tuple[int, LineResult]] = attrs.field(factory=list)
    #: Lines of a commit that failed without an answer: tried again, alone, before the buffer.
    unsure: list[tuple[int, LineResult]] | None = None
    segments_written: int = 0
    #: When the lease surely ends unless renewed (this replica's monotonic clock): when the claim
    #: or the last answered renewal was sent, plus the lease.
    valid_until: float = 0.0
    #: When the claim's answer came and the heartbeat was told of the lease: a renewal sent
    #: before then did not ask for it.
    claimed_at: float = 0.0
    #: Every line has ended and the last ones are being committed: the commit that ends the shard
    #: takes it out of the renewals, so a renewal that misses it does not say it was lost (the
    #: commit's fence says so).
    finishing: bool = False


class ShardRunner:
    """One replica's loop over the shared work (see the module's docstring)."""

    def __init__(
        self,
        ledger: PostgresShardLedger,
        segments: SegmentStore,
        run_line: LineFunction,
        *,
        replica_id: str,
        max_shards: int = 4,
        max_taken_over: int | None = None,
        concurrency: int = 16,
        ttl_s: float = DEFAULT_LEASE_S,
        commit_lines: int = 256,
        commit_interval_s: float = 1.0,
        poll_s: float = 0.5,
        watch_s: float = 0.5,
    ) -> None:
        if not 0 < ttl_s <= MAX_LEASE_S:
            raise ValueError(f"a lease lasts more than 0 and at most {MAX_LEASE_S:g} seconds, not {ttl_s!r}")
        if max_shards < 1 or concurrency < 1 or commit_lines < 1:
            raise ValueError("max_shards, concurrency and commit_lines must be positive")
        self.ledger = ledger
        self.segments = segments
        self.run_line = run_line
        #: This run's name in the ledger: the replica's id and a token of this start, so a
        #: restarted replica never renews the leases its dead predecessor held (they run out, and
        #: any replica takes them over, itself included).
        self.owner_id = f"{replica_id}/{secrets.token_hex(4)}"
        self.max_shards = max_shards
        #: Shards whose leases ran out unrenewed that it takes over beyond ``max_shards``: a
        #: dead replica's work starts again after its lease, not once a held shard ends.
        self.max_taken_over = max_shards if max_taken_over is None else max_taken_over
        self.ttl_s = ttl_s
        self.commit_lines = commit_lines
        self.commit_interval_s = commit_interval_s
        self.poll_s = poll_s
        self.watch_s = watch_s
        #: How long one release or watch may take before it counts as failed.
        self.call_timeout_s = ttl_s / 3
        #: How long one claim may take before it counts as failed: a whole lease. A slow claim
        #: costs no lease (the heartbeat's thread keeps those, and reports a database that does
        #: not answer it within a third of a lease), so a loop busy with thousands of lines is not
        #: called unhealthy for reading a claim's answer late.
        self.claim_timeout_s = ttl_s
        self._slots = ShardSlots(concurrency)
        self._held: dict[tuple[str, int], _HeldShard] = {}
        self._stopping = asyncio.Event()
        #: Set when a held shard ends or is dropped: room to claim another, without waiting for
        #: the next poll.
        self._room = asyncio.Event()
        #: Renews the held leases from a thread of its own while ``run`` runs.
        self._heartbeat: LeaseHeartbeat | None = None
        #: Monitoring: leases lost to expiry, takeover or cancel, and commits refused.
        self.leases_lost = 0
        self.shards_cancelled = 0
        self.commits_refused = 0
        #: Lines whose commit the database took, counted as each commit's answer is read.
        self.lines_committed = 0
        #: Commits on their way to the database, among them those of shards dropped meanwhile.
        self._committing: set[asyncio.Future[Any]] = set()
        #: What failed last and has not worked since, by part ("ledger claims", "ledger
        #: renewals", and "commit": writing segments and committing them).
        self._failing: dict[str, _Failing] = {}
        #: Why the runner must not run lines now, by part (``suspend``): no claim while any is set.
        self._suspended: dict[str, str] = {}
        #: How often each cause made a shard be given up: the first is logged with its
        #: traceback, the rest as counts (``_gave_up``), never a traceback per shard or line.
        self.give_ups: dict[str, int] = {}
        self._give_ups_logged: dict[str, float] = {}

    @property
    def healthy(self) -> bool:
        return not self.problems

    def suspend(self, part: str, reason: str) -> None:
        """Run nothing while ``reason`` holds (the blob store is not this cluster's, say): the
        held shards are let go at once, for replicas that can run them, and none is claimed until
        ``resume(part)``; the runner is unhealthy meanwhile."""
        if part not in self._suspended:
            logger.error("%s stops running lines: %s", self.owner_id, reason)
        self._suspended[part] = reason[:300]
        for shard in list(self._held.values()):
            self._drop(shard)
            task = asyncio.ensure_future(self.ledger.release(shard.lease))
            task.add_done_callback(read_outcome)

    def resume(self, part: str) -> None:
        """``reason`` of ``suspend(part)`` holds no more."""
        if self._suspended.pop(part, None) is not None:
            logger.warning("%s runs lines again: %s is resolved", self.owner_id, part)
            self._room.set()

    @property
    def problems(self) -> list[str]:
        """Why the runner is not healthy (the database or the store failing, or a ``suspend``),
        or nothing."""
        problems = dict(self._suspended)
        problems.update(
            (part, failing.detail)
            for part, failing in self._failing.items()
            if failing.calls >= FAILURES_REPORTED
        )
        return [f"{part}: {problem}" for part, problem in sorted(problems.items())]

    def _failed(self, part: str, error: Exception) -> _Failing:
        # a call given up by its timeout says nothing of itself
        detail = str(error) or ("no answer in time" if isinstance(error, TimeoutError) else "no detail")
        failing = self._failing.setdefault(part, _Failing(0, ""))
        failing.calls += 1
        failing.detail = f"{type(error).__name__}: {detail}"[:300]
        return failing

    def _worked(self, part: str) -> None:
        self._failing.pop(part, None)

    @property
    def held(self) -> list[Lease]:
        return [shard.lease for shard in self._held.values()]

    async def run(self) -> None:
        """Work until ``stop``; then release what is unfinished."""
        heartbeat = self._heartbeat = LeaseHeartbeat(
            self.ledger.url, self.owner_id, self.ttl_s, self._renewed
        )
        heartbeat.start()
        watch = asyncio.create_task(self._watch_stops(), name=f"{self.owner_id}-watch")
        try:
            while not self._stopping.is_set():
                self._room.clear()  # a shard that ends from now on wakes the wait below
                room = self.max_shards - len(self._held)
                rescue = self.max_shards + self.max_taken_over - len(self._held)
                claim: Awaitable[list[Lease]] | None = None
                if self._suspended:
                    pass  # nothing is claimed while the runner must not run lines
                elif room > 0:
                    claim = self.ledger.claim(self.owner_id, room, self.ttl_s)
                elif rescue > 0:  # every shard it may claim is held: only what a dead replica left
                    claim = self.ledger.take_over(self.owner_id, rescue, self.ttl_s)
                sent = time.monotonic()
                try:
                    leases = [] if claim is None else await answer_within(claim, self.claim_timeout_s)
                except Exception as error:  # the database is away: try again after a poll interval
                    logger.warning("%s could not claim shards", self.owner_id, exc_info=True)
                    self._failed("ledger claims", error)
                    leases = []
                else:
                    if claim is not None:
                        self._worked("ledger claims")
                claimed = [_HeldShard(lease, valid_until=sent + self.ttl_s) for lease in leases]
                for shard in claimed:
                    self._held[shard.lease.key] = shard
                if claimed:  # a claim answered late is renewed at once, before its lease runs out
                    heartbeat.hold(self.held, renew_now=time.monotonic() - sent > self.ttl_s / 3)
                # read after the heartbeat was told: a renewal sent later renews these leases
                answered = time.monotonic()
                for shard in claimed:
                    shard.claimed_at = answered
                    shard.task = asyncio.create_task(
                        self._run_shard(shard), name=f"{self.owner_id}-{shard.lease.key}"
                    )
                if not leases:  # until the next poll, or a shard held here ends or is dropped
                    waits = [asyncio.ensure_future(event.wait()) for event in (self._stopping, self._room)]
                    try:
                        await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for wait in waits:
                            wait.cancel()
        finally:
            watch.cancel()
            held = list(self._held.values())
            for shard in held:
                self._drop(shard)
            await asyncio.gather(
                heartbeat.stop(), watch, *(s.task for s in held if s.task is not None), return_exceptions=True
            )
            if self._committing:  # their answers: each is cancelled after call_timeout_s
                await asyncio.wait(set(self._committing), timeout=2 * self.call_timeout_s)
            for shard in held:  # what is not released runs out with its lease
                with contextlib.suppress(Exception):
                    await answer_within(self.ledger.release(shard.lease), self.call_timeout_s)

    def stop(self) -> None:
        self._stopping.set()

    def _renewed(self, renewals: Sequence[Renewal]) -> None:
        """Take in the heartbeat's renewals, oldest first (on the loop, whenever it gets to them):
        drop the shards they lost, count the kept ones' leases from when they were sent, then
        drop every shard whose lease surely ran out unrenewed."""
        for renewal in renewals:
            answer = renewal.answer
            if answer is None:  # the database is away (or cut off): leases run out
                error = renewal.error or RuntimeError("no answer")
                logger.warning("%s could not renew its leases: %r", self.owner_id, error)
                self._failed("ledger renewals", error)
                continue
            self._worked("ledger renewals")
            for key, shard in list(self._held.items()):
                epoch = shard.lease.epoch
                if answer.renewed.get(key) == epoch:
                    shard.valid_until = max(shard.valid_until, renewal.sent + self.ttl_s)
                # not judged: a commit holds it (live, not extended), or it was claimed while the
                # renewal ran (not asked for), or its last commit says whether it was lost
                elif not (
                    answer.busy.get(key) == epoch or shard.claimed_at >= renewal.sent or shard.finishing
                ):
                    logger.info("%s lost shard %s of %s", self.owner_id, key[1], key[0])
                    self._drop(shard)
                    self.leases_lost += 1
        self._drop_expired(time.monotonic())

    async def _watch_stops(self) -> None:
        """Drop the shards of batches that stopped running (a cancel on any replica)."""
        while True:
            await asyncio.sleep(self.watch_s)
            # the renewals drop these too; here, a heartbeat that stopped answering drops them anyway
            # (after taking in the renewals it made that still wait for the loop: they count)
            if self._heartbeat is not None:
                self._heartbeat.hand_over()
            self._drop_expired(time.monotonic())
            batch_ids = sorted({key[0] for key in self._held})
            if not batch_ids:
                continue
            try:
                stopped = await answer_within(self.ledger.stopped(batch_ids), self.call_timeout_s)
            except Exception:  # the heartbeat reports the ledger's health; renewals drop these too
                logger.debug("%s could not watch its batches", self.owner_id, exc_info=True)
                continue
            for key, shard in list(self._held.items()):
                if key[0] in stopped:
                    logger.info("%s stops shard %s of %s: the batch stopped", self.owner_id, key[1], key[0])
                    self._drop(shard)
                    self.shards_cancelled += 1

    def _drop_expired(self, now: float) -> None:
        """Drop every shard whose lease surely ended unrenewed (the database gave it away)."""
        for key, shard in list(self._held.items()):
            if shard.valid_until <= now:
                logger.info(
                    "%s let shard %s of %s go: its lease ran out unrenewed", self.owner_id, key[1], key[0]
                )
                self._drop(shard)
                self.leases_lost += 1

    def _drop(self, shard: _HeldShard) -> None:
        if self._held.get(shard.lease.key) is shard:
            del self._held[shard.lease.key]
            if self._heartbeat is not None:  # not renewed any more: a lease still live runs out
                self._heartbeat.hold(self.held)
            self._room.set()  # the claim loop may take another shard now
        if shard.task is not None and shard.task is not asyncio.current_task():
            shard.task.cancel()
        for line in shard.lines:
            line.cancel()

    async def _run_shard(self, shard: _HeldShard) -> None:
        lease = shard.lease
        try:
            # each line's task reports to the queue as it ends: one wait per line, not a wait
            # over every task of the shard each time one ends
            ended: asyncio.Queue[asyncio.Task[tuple[int, LineResult]]] = asyncio.Queue()
            pending = shard.lines
            for line in lease.remaining:
                task = asyncio.create_task(self._run_one(lease.key, line))
                task.add_done_callback(read_outcome)  # a failure is read once, below, not at GC
                task.add_done_callback(ended.put_nowait)
                pending.add(task)
            last_commit = time.monotonic()
            try:
                while pending:
                    wait_s = self.commit_interval_s - (time.monotonic() - last_commit)
                    done = []
                    with contextlib.suppress(TimeoutError):
                        done.append(await answer_within(ended.get(), max(wait_s, 0.001)))
                    while not ended.empty():
                        done.append(ended.get_nowait())
                    pending.difference_update(done)
                    shard.buffer.extend(task.result() for task in done)
                    shard.finishing = not pending  # the next commit may end the shard
                    due = time.monotonic() - last_commit >= self.commit_interval_s
                    if shard.unsure is not None or (
                        shard.buffer and (len(shard.buffer) >= self.commit_lines or due)
                    ):
                        await self._commit(shard)
                        last_commit = time.monotonic()
            finally:
                for task in pending:
                    task.cancel()
            shard.finishing = True  # a shard with no line left to run
            while (
                shard.buffer or shard.unsure is not None
            ):  # the last lines: until they are committed, or the lease is lost
                if not await self._commit(shard):
                    await asyncio.sleep(min(1.0, self.ttl_s / 3))
            self._drop(shard)
            try:
                await self.ledger.finish_if_done(lease.batch_id)
            except Exception:  # whoever commits this batch's last shard next tries again
                logger.warning("%s could not finish %s", self.owner_id, lease.batch_id, exc_info=True)
        except CommitRefused:
            self.commits_refused += 1
            self._drop(shard)
        except Exception as error:  # run_line failed (a bug: it reports errors as lines): let it go
            self._gave_up(lease, error)
            self._drop(shard)
            with contextlib.suppress(Exception):
                await self.ledger.release(lease)

    def _gave_up(self, lease: Lease, error: Exception) -> None:
        """Log a shard given up: the first time for a cause with its traceback, then at most once
        a minute per cause, with how many times it happened."""
        cause = f"{type(error).__name__}: {error}"[:300]
        count = self.give_ups[cause] = self.give_ups.get(cause, 0) + 1
        now = time.monotonic()
        if count == 1:
            logger.error(
                "%s gives up shard %s of %s: %s",
                self.owner_id,
                lease.shard.shard_no,
                lease.batch_id,
                cause,
                exc_info=error,
            )
            self._give_ups_logged[cause] = now
        elif now - self._give_ups_logged.get(cause, 0.0) >= GIVE_UP_LOG_EVERY_S:
            logger.error("%s gave up shards %d times so far for: %s", self.owner_id, count, cause)
            self._give_ups_logged[cause] = now

    async def _run_one(self, shard: tuple[str, int], line: int) -> tuple[int, LineResult]:
        await self._slots.acquire(shard)
        try:
            return line, await self.run_line(shard[0], line)
        finally:
            self._slots.release(shard)

    async def _commit(self, shard: _HeldShard) -> bool:
        """Write the shard's buffer as segments and commit them; False (the lines kept, to be
        committed later) when the store or the database failed. CommitRefused: the lease is lost.

        A commit whose answer was lost (the connection broke after the database committed) is
        tried again with exactly the same lines, alone: ``LineCommittedTwice`` then means that
        it did commit."""
        lease = shard.lease
        retrying = shard.unsure is not None
        finished = shard.unsure if shard.unsure is not None else shard.buffer
        if not retrying:
            shard.buffer = []
        shard.unsure = None
        try:
            parts = []
            for kind in SEGMENT_KINDS:
                lines = sorted((line, result) for line, result in finished if result.kind == kind)
                if not lines:
                    continue
                # a new key for every try: a failed try's file is an orphan, never rewritten
                key = segment_key(
                    lease.batch_id, kind, lease.shard.shard_no, lease.epoch, shard.segments_written
                )
                shard.segments_written += 1
                data = b"".join(result.data for _, result in lines)
                size = await asyncio.to_thread(self.segments.write, key, data)
                results = [result for _, result in lines]
                parts.append(
                    SegmentPart(
                        kind,
                        key,
                        size,
                        tuple(line for line, _ in lines),
                        failed_lines=sum(result.outcome is LineOutcome.FAILED for result in results),
                        prompt_tokens=sum(result.prompt_tokens for result in results),
                        completion_tokens=sum(result.completion_tokens for result in results),
                        prefix_cached_tokens=sum(result.prefix_cached_tokens for result in results),
                    )
                )
            sent = time.monotonic()
            committing = asyncio.ensure_future(self.ledger.commit(lease, parts, renew_s=self.ttl_s))
            self._committing.add(committing)
            committing.add_done_callback(functools.partial(self._commit_ended, len(finished)))
            try:
                await asyncio.shield(committing)
            except asyncio.CancelledError:
                # the shard was dropped while its commit was on its way: the database may have
                # taken it already, so its answer is still read (and a commit that landed is
                # counted), for at most ``call_timeout_s``
                asyncio.get_running_loop().call_later(self.call_timeout_s, committing.cancel)
                raise
            # it renewed the lease once its fence passed, after it was sent
            shard.valid_until = max(shard.valid_until, sent + self.ttl_s)
        except CommitRefused:
            raise
        except LineCommittedTwice:
            if not retrying:
                raise
            # the earlier try of these very lines, whose answer was lost, did commit
            self.lines_committed += len(finished)
        except Exception as error:
            failing = self._failed("commit", error)
            logger.warning(
                "%s could not commit shard %s of %s: %s",
                self.owner_id,
                lease.shard.shard_no,
                lease.batch_id,
                failing.detail,
                exc_info=failing.calls == 1,  # the traceback once, not once per try
            )
            shard.unsure = finished
            return False
        self._worked("commit")
        return True

    def _commit_ended(self, lines: int, commit: asyncio.Future[Any]) -> None:
        """Count the lines of a commit that landed, when its answer comes, even when its shard
        was dropped meanwhile."""
        self._committing.discard(commit)
        if not commit.cancelled() and commit.exception() is None:
            self.lines_committed += lines


async def collect_orphans(
    ledger: PostgresShardLedger, segments: SegmentStore, grace_s: float = ORPHAN_GRACE_S
) -> int:
    """Delete the segments of this ledger's batches that no commit lists and that are older than
    ``grace_s`` (written by replicas that died or were fenced out before committing); how many were
    deleted. Any replica may run it: what it deletes was never served and never will be. A segment
    of a batch the ledger does not know is left alone: it is no orphan of this cluster's."""
    known = await ledger.known_batches()
    committed = await ledger.committed_keys()
    orphans = await asyncio.to_thread(segments.orphans, committed, known, grace_s)
    return await asyncio.to_thread(segments.collect, orphans)
