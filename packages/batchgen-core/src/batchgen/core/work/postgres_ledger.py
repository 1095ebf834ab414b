"""PostgresShardLedger: who runs which shard of which batch, and which output exists, in Postgres.

Four tables (created by ``create_schema``, idempotent):

``batch_work``      one row per batch the replicas share: ``running``, ``cancelled`` or
                    ``finished`` (and when it stopped running, ``ended_at``, and why a cancelled
                    one was, ``stop_reason``); its tenant; the counters of committed lines and of
                    their tokens; the next segment number.
``batch_shards``    one row per shard: ``pending``, ``leased`` (to ``owner_id`` until
                    ``lease_expires_at``) or ``done``; its ``epoch``, raised at every lease; the
                    lines committed so far (``done_lines``).
``batch_segments``  the manifest: every committed segment, numbered in commit order per batch.
``replica_reports`` what each running replica last said of its work (shards held, lines
                    committed, leases lost), when: what every replica's dashboard lists.

Rules the SQL keeps, whatever the replicas do:

- Every time is the database's (``clock_timestamp()``), never a replica's clock.
- A claim takes shards that are pending or whose lease has run out, ``FOR UPDATE SKIP LOCKED``,
  so two claimers never get one shard; it raises the shard's epoch. Tenants take turns, and a
  tenant's batches take turns: the next shard goes to the tenant whose running batches hold the
  fewest live leases for its weight (leases / weight: a tenant of weight 2 gets two shards to
  another's one), and of its batches to the one holding the fewest (then the older batch).
  A small batch behind a huge one gets its shards at once and finishes first, and one tenant's
  many batches do not crowd out another's one.
- A commit is one short transaction, fenced: it counts only while the committing lease is the
  shard's current one (same owner, same epoch, not expired) and the batch is running; otherwise
  ``CommitRefused`` and nothing changes. A line can be committed once: a commit listing a line
  already committed raises ``LineCommittedTwice`` and changes nothing.
- Commits of one batch are serialised on its ``batch_work`` row, which numbers them: the manifest
  of a batch only ever grows at its end, so a reader's bytes for a committed state never move.
  A commit locks that row before its shard's, so only the running commit holds a shard row,
  and it may renew the lease it was fenced by (``renew_s``), which a renewal skips meanwhile.
- A renewal extends only live leases of running batches, and returns them: a held shard missing
  from the answer was lost (expired, taken over, or its batch cancelled), and its work must stop.
  A heartbeat's renewal (``renew_held``) extends only the leases its owner lists (one it let go
  runs out) and waits for no commit: a shard a commit holds is answered as busy, not extended.
- ``finish_if_done`` turns a running batch whose shards are all done ``finished`` for exactly one
  caller.
- A batch added with intake limits is admitted under one advisory lock, against the unfinished
  lines and running batches of every replica (``intake``): two replicas never admit past a limit.

psycopg 3 with its async pool: every call awaits the network without blocking the event loop,
and the connections are in autocommit mode, with explicit transactions where a call needs one.
The pool is sized by the caller (``max_connections``). A replica's renewals do not use it:
``renew_held`` runs on a connection of the caller's (``lease_heartbeat``: a thread of its own, which
nothing on the pool's loop can delay).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import attrs
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from batchgen.core.models import DEFAULT_TENANT
from batchgen.core.storage.postgres_schema import make_schema_async
from batchgen.core.work.intake import IntakeFull, IntakeHeld, IntakeLimits
from batchgen.core.work.shards import (
    MAX_LEASE_S,
    SHARD_LINES,
    Lease,
    Segment,
    SegmentPart,
    ShardRange,
    check_lines,
    plan_shards,
)

__all__ = [
    "BatchWork",
    "CommitRefused",
    "HeldRenewal",
    "LineCommittedTwice",
    "PostgresShardLedger",
    "renew_held",
]

RUNNING, CANCELLED, FINISHED = "running", "cancelled", "finished"

#: Serialises concurrent ``create_schema`` calls of replicas starting together.
_SCHEMA_LOCK = 0x6261_7463_6867_656E  # "batchgen"
#: Serialises admissions under limits (``add_batch`` with ``limits``): one at a time, everywhere.
_INTAKE_LOCK = 0x6267_696E_7461_6B65  # "bgintake"

_HELD = """
SELECT COALESCE(sum(line_count - completed - failed), 0)::bigint,
       COALESCE(sum(line_count - completed - failed) FILTER (WHERE tenant = %(tenant)s), 0)::bigint,
       count(*) FILTER (WHERE tenant = %(tenant)s)
FROM batch_work WHERE status = 'running'
"""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_work (
    batch_id text PRIMARY KEY,
    status text NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'cancelled', 'finished')),
    created_no bigserial,
    line_count integer NOT NULL CHECK (line_count >= 0),
    completed integer NOT NULL DEFAULT 0,
    failed integer NOT NULL DEFAULT 0,
    segments bigint NOT NULL DEFAULT 0,
    tenant text NOT NULL DEFAULT 'default'
);
ALTER TABLE batch_work ADD COLUMN IF NOT EXISTS tenant text NOT NULL DEFAULT 'default';
ALTER TABLE batch_work ADD COLUMN IF NOT EXISTS ended_at timestamptz;
ALTER TABLE batch_work ADD COLUMN IF NOT EXISTS stop_reason text;
ALTER TABLE batch_work ADD COLUMN IF NOT EXISTS weight float8 NOT NULL DEFAULT 1 CHECK (weight > 0);
ALTER TABLE batch_work ADD COLUMN IF NOT EXISTS prompt_tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE batch_work ADD COLUMN IF NOT EXISTS completion_tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE batch_work ADD COLUMN IF NOT EXISTS prefix_cached_tokens bigint NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS batch_work_running ON batch_work (tenant) WHERE status = 'running';
CREATE TABLE IF NOT EXISTS batch_shards (
    batch_id text NOT NULL REFERENCES batch_work ON DELETE CASCADE,
    shard_no integer NOT NULL,
    first_line integer NOT NULL,
    n_lines integer NOT NULL CHECK (n_lines > 0),
    state text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'leased', 'done')),
    owner_id text,
    epoch bigint NOT NULL DEFAULT 0,
    lease_expires_at timestamptz,
    attempts integer NOT NULL DEFAULT 0,
    done_lines integer[] NOT NULL DEFAULT '{}',
    PRIMARY KEY (batch_id, shard_no)
);
CREATE INDEX IF NOT EXISTS batch_shards_open ON batch_shards (batch_id) WHERE state <> 'done';
CREATE INDEX IF NOT EXISTS batch_shards_owner ON batch_shards (owner_id) WHERE state = 'leased';
CREATE TABLE IF NOT EXISTS replica_reports (
    owner_id text PRIMARY KEY,
    replica_id text NOT NULL,
    report jsonb NOT NULL,
    seen_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS batchgen_cluster (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    cluster_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS batch_segments (
    batch_id text NOT NULL REFERENCES batch_work ON DELETE CASCADE,
    seq bigint NOT NULL,
    kind text NOT NULL CHECK (kind IN ('output', 'errors')),
    shard_no integer NOT NULL,
    epoch bigint NOT NULL,
    object_key text NOT NULL UNIQUE,
    size bigint NOT NULL CHECK (size >= 0),
    lines integer[] NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (batch_id, seq)
);
"""

_LIVE = "state = 'leased' AND lease_expires_at > clock_timestamp()"
_CLAIMABLE = "(s.state = 'pending' OR (s.state = 'leased' AND s.lease_expires_at <= clock_timestamp()))"

_CLAIM = f"""
WITH live AS (
    SELECT batch_id, count(*) FILTER (WHERE {_LIVE}) AS leased
    FROM batch_shards WHERE state <> 'done' GROUP BY batch_id
), tenant_live AS (
    SELECT w.tenant, sum(live.leased) AS leased, max(w.weight) AS weight
    FROM live JOIN batch_work w USING (batch_id) WHERE w.status = 'running' GROUP BY w.tenant
), ranked AS (
    SELECT s.batch_id, s.shard_no, w.created_no, w.tenant,
           live.leased + row_number() OVER (PARTITION BY s.batch_id ORDER BY s.shard_no) AS turn
    FROM batch_shards s JOIN batch_work w USING (batch_id) JOIN live USING (batch_id)
    WHERE w.status = 'running' AND {_CLAIMABLE}
), tenant_ranked AS (
    SELECT r.batch_id, r.shard_no, r.created_no, r.turn,
           (tenant_live.leased
             + row_number() OVER (PARTITION BY r.tenant ORDER BY r.turn, r.created_no, r.shard_no))
             / tenant_live.weight AS tenant_turn
    FROM ranked r JOIN tenant_live USING (tenant)
), picked AS (
    SELECT s.batch_id, s.shard_no FROM batch_shards s JOIN tenant_ranked r USING (batch_id, shard_no)
    WHERE {_CLAIMABLE}
    ORDER BY r.tenant_turn, r.turn, r.created_no, s.shard_no
    LIMIT %(limit)s
    FOR UPDATE OF s SKIP LOCKED
)
UPDATE batch_shards s
SET state = 'leased', owner_id = %(owner)s, epoch = s.epoch + 1, attempts = s.attempts + 1,
    lease_expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
FROM picked p
WHERE s.batch_id = p.batch_id AND s.shard_no = p.shard_no
RETURNING s.batch_id, s.shard_no, s.first_line, s.n_lines, s.epoch, s.done_lines
"""

#: Only leases that ran out unrenewed (their owner died, or was cut off), the oldest first: what
#: a replica with every shard it may claim already held still takes over (``take_over``).
_TAKE_OVER = """
WITH picked AS (
    SELECT s.batch_id, s.shard_no FROM batch_shards s JOIN batch_work w USING (batch_id)
    WHERE w.status = 'running' AND s.state = 'leased' AND s.lease_expires_at <= clock_timestamp()
    ORDER BY s.lease_expires_at, s.batch_id, s.shard_no
    LIMIT %(limit)s
    FOR UPDATE OF s SKIP LOCKED
)
UPDATE batch_shards s
SET owner_id = %(owner)s, epoch = s.epoch + 1, attempts = s.attempts + 1,
    lease_expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
FROM picked p
WHERE s.batch_id = p.batch_id AND s.shard_no = p.shard_no
RETURNING s.batch_id, s.shard_no, s.first_line, s.n_lines, s.epoch, s.done_lines
"""

_RENEW = """
UPDATE batch_shards s SET lease_expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
FROM batch_work w
WHERE s.owner_id = %(owner)s AND s.state = 'leased' AND s.lease_expires_at > clock_timestamp()
  AND w.batch_id = s.batch_id AND w.status = 'running'
RETURNING s.batch_id, s.shard_no, s.epoch
"""

#: A heartbeat's renewal of the leases its owner lists (batch ids, shard numbers and epochs, as
#: three arrays): a lease it let go is not kept alive. It waits for no lock: a shard row that a
#: commit in flight holds is skipped, and answered apart as busy (live when the commit began).
_RENEW_HELD = f"""
WITH held AS (
    SELECT * FROM unnest(%(batches)s::text[], %(shards)s::integer[], %(epochs)s::bigint[])
        AS held(batch_id, shard_no, epoch)
), live AS (
    SELECT s.batch_id, s.shard_no, s.epoch FROM batch_shards s
    JOIN held USING (batch_id, shard_no, epoch) JOIN batch_work w USING (batch_id)
    WHERE s.owner_id = %(owner)s AND {_LIVE} AND w.status = 'running'
), free AS (
    SELECT s.batch_id, s.shard_no FROM batch_shards s JOIN live USING (batch_id, shard_no, epoch)
    FOR UPDATE OF s SKIP LOCKED
), renewed AS (
    UPDATE batch_shards s SET lease_expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
    FROM free WHERE s.batch_id = free.batch_id AND s.shard_no = free.shard_no
      AND s.owner_id = %(owner)s AND {_LIVE}
    RETURNING s.batch_id, s.shard_no, s.epoch
)
SELECT batch_id, shard_no, epoch, true FROM renewed
UNION ALL
SELECT batch_id, shard_no, epoch, false FROM live
WHERE (batch_id, shard_no) NOT IN (SELECT batch_id, shard_no FROM free)
"""

_FENCE = f"""
SELECT first_line, n_lines, done_lines FROM batch_shards
WHERE batch_id = %(batch)s AND shard_no = %(shard)s AND owner_id = %(owner)s AND epoch = %(epoch)s
  AND {_LIVE}
FOR UPDATE
"""

#: ``_FENCE`` that also renews the lease it checks (``commit``'s ``renew_s``): a commit that holds
#: the shard's row, which a heartbeat's renewal skips, does not let its lease run out meanwhile.
_FENCE_RENEW = f"""
UPDATE batch_shards
SET lease_expires_at = greatest(lease_expires_at, clock_timestamp() + %(renew)s * interval '1 second')
WHERE batch_id = %(batch)s AND shard_no = %(shard)s AND owner_id = %(owner)s AND epoch = %(epoch)s
  AND {_LIVE}
RETURNING first_line, n_lines, done_lines
"""


class CommitRefused(Exception):
    """A commit under a lease that is no longer the shard's, or for a batch no longer running:
    nothing was recorded. The replica must drop the shard's work."""


class LineCommittedTwice(ValueError):
    """A commit listed a line that an earlier commit already holds: nothing was recorded."""


@attrs.frozen
class BatchWork:
    """A shared batch as the ledger holds it."""

    batch_id: str
    status: str
    line_count: int
    completed: int
    failed: int
    shards: int
    shards_done: int
    #: When it stopped running (finished or cancelled), on the database's clock: the same moment
    #: for every replica that reads it (Unix seconds); None while it runs.
    ended_at: float | None = None
    #: Why a cancelled batch was stopped (``cancel``'s ``reason``): the first stop's, for everyone.
    stop_reason: str | None = None
    #: The tokens of the committed answers, and of their prompts those prefix caches served.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_cached_tokens: int = 0


@attrs.frozen
class HeldRenewal:
    """What ``renew_held`` did, as (batch id, shard number) -> epoch: the leases it extended, and
    those it could not extend now (a commit in flight holds the shard; live when it began). A
    listed lease in neither was lost."""

    renewed: Mapping[tuple[str, int], int]
    busy: Mapping[tuple[str, int], int]


class PostgresShardLedger:
    """The shard ledger over a pool of connections to ``url`` (``postgresql://...``).

    Use as ``async with PostgresShardLedger(url) as ledger:``, or ``open``/``close``.
    """

    def __init__(self, url: str, *, max_connections: int = 4, connect_timeout_s: float = 10.0) -> None:
        #: The database's URL: where a ``LeaseHeartbeat`` opens its own connection.
        self.url = url
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            open=False,
            timeout=connect_timeout_s,
            # a connection the server dropped (a restart) is replaced before use, not handed out
            check=AsyncConnectionPool.check_connection,
            kwargs={"autocommit": True, "connect_timeout": max(1, round(connect_timeout_s))},
        )

    async def open(self) -> None:
        await self._pool.open(wait=True)

    async def close(self) -> None:
        await self._pool.close()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    async def _rows(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        async with self._pool.connection() as conn:
            cursor = await conn.execute(sql, params)
            return await cursor.fetchall() if cursor.description is not None else []

    async def create_schema(self) -> None:
        """Create the tables and indexes if they are missing (safe with replicas starting at once);
        only a read when ``storage.postgres_schema`` says they are there already."""
        async with self._pool.connection() as conn:
            await make_schema_async(conn, "ledger", [_SCHEMA], _SCHEMA_LOCK)

    # --- batches --------------------------------------------------------------------------

    async def add_batch(
        self,
        batch_id: str,
        line_count: int,
        shard_lines: int = SHARD_LINES,
        *,
        tenant: str = DEFAULT_TENANT,
        limits: IntakeLimits | None = None,
        weight: float = 1.0,
    ) -> bool:
        """Share a batch of ``line_count`` lines of ``tenant``, cut into shards; False if it is
        there already (a second replica starting the same batch changes nothing).

        With ``limits``, the batch is admitted only if it fits what every replica together
        holds (``intake``), decided under one lock in the database: ``IntakeFull`` (nothing
        recorded) when it does not fit now. ``weight`` is the tenant's share weight: a tenant of
        weight 2 holds twice the leases of one of weight 1 while both have work."""
        if not weight > 0:
            raise ValueError(f"a tenant's weight is more than 0, not {weight!r}")
        shards = plan_shards(line_count, shard_lines)
        async with self._pool.connection() as conn, conn.transaction():
            if limits is not None:
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INTAKE_LOCK,))
                known = await conn.execute("SELECT 1 FROM batch_work WHERE batch_id = %s", (batch_id,))
                if await known.fetchone() is not None:
                    return False
                row = await (await conn.execute(_HELD, {"tenant": tenant})).fetchone()
                held = IntakeHeld(*row) if row is not None else IntakeHeld(0, 0, 0)
                refused = held.refusal(limits, tenant, line_count)
                if refused is not None:
                    raise IntakeFull(*refused, held)
            cursor = await conn.execute(
                "INSERT INTO batch_work (batch_id, line_count, tenant, weight) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (batch_id) DO NOTHING RETURNING batch_id",
                (batch_id, line_count, tenant, weight),
            )
            if await cursor.fetchone() is None:
                return False
            async with conn.cursor() as insert:
                await insert.executemany(
                    "INSERT INTO batch_shards (batch_id, shard_no, first_line, n_lines) VALUES (%s, %s, %s, %s)",
                    [(batch_id, shard.shard_no, shard.first_line, shard.n_lines) for shard in shards],
                )
            if not shards:  # an empty batch has nothing to run
                await conn.execute(
                    "UPDATE batch_work SET status = 'finished', ended_at = clock_timestamp() WHERE batch_id = %s",
                    (batch_id,),
                )
        return True

    async def cancel(self, batch_id: str, reason: str = "cancelled") -> bool:
        """Stop a running batch: no more claims or commits, and its owners lose their shards at
        their next renewal. False if it was not running (then an earlier stop's ``reason`` stays)."""
        rows = await self._rows(
            "UPDATE batch_work SET status = 'cancelled', ended_at = clock_timestamp(), stop_reason = %(reason)s "
            "WHERE batch_id = %(batch)s AND status = 'running' "
            "RETURNING batch_id",
            {"batch": batch_id, "reason": reason},
        )
        return bool(rows)

    async def stopped(self, batch_ids: Sequence[str]) -> set[str]:
        """Which of ``batch_ids`` no longer run (cancelled, or finished): one indexed read, cheap
        enough for every replica to ask about the batches it runs twice a second."""
        if not batch_ids:
            return set()
        rows = await self._rows(
            "SELECT batch_id FROM batch_work WHERE batch_id = ANY(%(batches)s) AND status <> 'running'",
            {"batches": list(batch_ids)},
        )
        return {batch_id for (batch_id,) in rows}

    async def finish_if_done(self, batch_id: str) -> bool:
        """Mark a running batch whose shards are all done finished; True for exactly one caller."""
        rows = await self._rows(
            "UPDATE batch_work SET status = 'finished', ended_at = clock_timestamp() "
            "WHERE batch_id = %(batch)s AND status = 'running' "
            "AND NOT EXISTS (SELECT 1 FROM batch_shards WHERE batch_id = %(batch)s AND state <> 'done') "
            "RETURNING batch_id",
            {"batch": batch_id},
        )
        return bool(rows)

    async def batch(self, batch_id: str) -> BatchWork | None:
        rows = await self._rows(
            "SELECT w.batch_id, w.status, w.line_count, w.completed, w.failed, count(s.shard_no), "
            "count(s.shard_no) FILTER (WHERE s.state = 'done'), extract(epoch FROM w.ended_at)::float8, "
            "w.stop_reason, w.prompt_tokens, w.completion_tokens, w.prefix_cached_tokens "
            "FROM batch_work w LEFT JOIN batch_shards s USING (batch_id) WHERE w.batch_id = %(batch)s "
            "GROUP BY w.batch_id",
            {"batch": batch_id},
        )
        return BatchWork(*rows[0]) if rows else None

    # --- leases ---------------------------------------------------------------------------

    async def claim(self, owner_id: str, limit: int, ttl_s: float) -> list[Lease]:
        """Lease up to ``limit`` shards to ``owner_id`` for ``ttl_s`` seconds of the database's clock."""
        return await self._lease(_CLAIM, owner_id, limit, ttl_s)

    async def take_over(self, owner_id: str, limit: int, ttl_s: float) -> list[Lease]:
        """Lease to ``owner_id`` up to ``limit`` shards whose leases ran out unrenewed (and no
        pending ones), the longest expired first, each at a new epoch."""
        return await self._lease(_TAKE_OVER, owner_id, limit, ttl_s)

    async def _lease(self, sql: str, owner_id: str, limit: int, ttl_s: float) -> list[Lease]:
        _check_ttl(ttl_s)
        if limit < 1:
            return []
        rows = await self._rows(sql, {"owner": owner_id, "limit": limit, "ttl": ttl_s})
        return sorted(
            (
                Lease(batch, ShardRange(shard, first, count), owner_id, epoch, frozenset(done))
                for batch, shard, first, count, epoch, done in rows
            ),
            key=lambda lease: lease.key,
        )

    # --- replicas' reports ------------------------------------------------------------------

    async def report_replica(self, owner_id: str, replica_id: str, report: Mapping[str, Any]) -> None:
        """Save what a replica says of its work now (its ``/health`` replica block), stamped with
        the database's clock; reports not renewed for a day are deleted on the way."""
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO replica_reports (owner_id, replica_id, report, seen_at) "
                "VALUES (%(owner)s, %(replica)s, %(report)s, clock_timestamp()) "
                "ON CONFLICT (owner_id) DO UPDATE SET report = EXCLUDED.report, seen_at = EXCLUDED.seen_at",
                {"owner": owner_id, "replica": replica_id, "report": Jsonb(dict(report))},
            )
            await conn.execute(
                "DELETE FROM replica_reports WHERE seen_at < clock_timestamp() - interval '1 day'"
            )

    async def replica_reports(self, within_s: float) -> list[dict[str, Any]]:
        """Every replica's last report made in the last ``within_s`` seconds, by replica id, each
        with ``seen_s_ago`` (on the database's clock)."""
        rows = await self._rows(
            "SELECT report, EXTRACT(EPOCH FROM clock_timestamp() - seen_at)::float8 FROM replica_reports "
            "WHERE seen_at > clock_timestamp() - %(within)s * interval '1 second' "
            "ORDER BY replica_id, owner_id",
            {"within": within_s},
        )
        return [{**report, "seen_s_ago": round(max(0.0, age), 1)} for report, age in rows]

    async def renew(self, owner_id: str, ttl_s: float) -> dict[tuple[str, int], int]:
        """Extend every live lease of ``owner_id`` on a running batch by ``ttl_s`` seconds; the
        leases it still holds, as (batch id, shard number) -> epoch."""
        _check_ttl(ttl_s)
        rows = await self._rows(_RENEW, {"owner": owner_id, "ttl": ttl_s})
        return {(batch, shard): epoch for batch, shard, epoch in rows}

    async def release(self, lease: Lease) -> bool:
        """Give a leased shard back before its lease runs out (a replica stopping cleanly), so
        another replica takes it at once; False if the lease was no longer the shard's."""
        rows = await self._rows(
            "UPDATE batch_shards SET state = 'pending', owner_id = NULL, lease_expires_at = NULL "
            "WHERE batch_id = %(batch)s AND shard_no = %(shard)s AND owner_id = %(owner)s "
            "AND epoch = %(epoch)s AND state = 'leased' RETURNING shard_no",
            _lease_params(lease),
        )
        return bool(rows)

    # --- output ---------------------------------------------------------------------------

    async def commit(
        self, lease: Lease, parts: Sequence[SegmentPart], *, renew_s: float | None = None
    ) -> list[Segment]:
        """Make ``parts`` (segments already written to the segment store) part of the batch's
        output, fenced by ``lease``: all of them or, with ``CommitRefused`` or
        ``LineCommittedTwice``, none. The shard is done once every one of its lines is committed.
        With ``renew_s``, a commit that counts also renews the lease for that long from when its
        fence passed."""
        lines = [line for part in parts for line in part.lines]
        check_lines(lease.shard, lines)
        params: dict[str, Any] = _lease_params(lease)
        if renew_s is not None:
            _check_ttl(renew_s)
            params["renew"] = renew_s
        async with self._pool.connection() as conn, conn.transaction():
            # the batch's row first: commits of a batch queue there holding no shard's row, so a
            # heartbeat's renewal finds every shard free but the one whose commit runs now
            await conn.execute(
                "SELECT 1 FROM batch_work WHERE batch_id = %(batch)s FOR NO KEY UPDATE", params
            )
            cursor = await conn.execute(_FENCE if renew_s is None else _FENCE_RENEW, params)
            fenced = await cursor.fetchone()
            if fenced is None:
                raise CommitRefused(
                    f"shard {lease.shard.shard_no} of {lease.batch_id} is no longer leased to "
                    f"{lease.owner_id} at epoch {lease.epoch}"
                )
            _, n_lines, done = fenced
            again = set(done).intersection(lines)
            if again:
                raise LineCommittedTwice(
                    f"lines {sorted(again)[:5]} of {lease.batch_id} are committed already"
                )
            completed = sum(part.completed_lines for part in parts)
            failed = sum(part.failed_lines for part in parts)
            cursor = await conn.execute(
                "UPDATE batch_work SET completed = completed + %(completed)s, failed = failed + %(failed)s, "
                "segments = segments + %(parts)s, prompt_tokens = prompt_tokens + %(prompt)s, "
                "completion_tokens = completion_tokens + %(completion)s, "
                "prefix_cached_tokens = prefix_cached_tokens + %(cached)s "
                "WHERE batch_id = %(batch)s AND status = 'running' RETURNING segments",
                {
                    **params,
                    "completed": completed,
                    "failed": failed,
                    "parts": len(parts),
                    "prompt": sum(part.prompt_tokens for part in parts),
                    "completion": sum(part.completion_tokens for part in parts),
                    "cached": sum(part.prefix_cached_tokens for part in parts),
                },
            )
            counted = await cursor.fetchone()
            if counted is None:
                raise CommitRefused(f"{lease.batch_id} is not running")
            first_seq = counted[0] - len(parts)
            segments = [
                Segment(
                    lease.batch_id,
                    part.kind,
                    lease.shard.shard_no,
                    first_seq + offset,
                    lease.epoch,
                    part.object_key,
                    part.size,
                    tuple(part.lines),
                )
                for offset, part in enumerate(parts)
            ]
            async with conn.cursor() as insert:
                await insert.executemany(
                    "INSERT INTO batch_segments (batch_id, seq, kind, shard_no, epoch, object_key, size, lines) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    [
                        (s.batch_id, s.seq, s.kind, s.shard_no, s.epoch, s.object_key, s.size, list(s.lines))
                        for s in segments
                    ],
                )
            all_done = len(done) + len(lines) == n_lines
            await conn.execute(
                "UPDATE batch_shards SET done_lines = done_lines || %(lines)s::integer[], "
                "state = CASE WHEN %(all_done)s THEN 'done' ELSE state END, "
                "owner_id = CASE WHEN %(all_done)s THEN NULL ELSE owner_id END "
                "WHERE batch_id = %(batch)s AND shard_no = %(shard)s",
                {**params, "lines": lines, "all_done": all_done},
            )
        return segments

    async def segments(self, batch_id: str, kind: str | None = None) -> list[Segment]:
        """The committed segments of a batch (of one ``kind``, or all), in commit order."""
        rows = await self._rows(
            "SELECT batch_id, kind, shard_no, seq, epoch, object_key, size, lines FROM batch_segments "
            "WHERE batch_id = %(batch)s AND (%(kind)s::text IS NULL OR kind = %(kind)s) ORDER BY seq",
            {"batch": batch_id, "kind": kind},
        )
        return [
            Segment(b, k, shard, seq, epoch, key, size, tuple(lines))
            for b, k, shard, seq, epoch, key, size, lines in rows
        ]

    async def forget_segments(self, batch_id: str, kind: str) -> list[str]:
        """Take a batch's committed segments of one ``kind`` out of the manifest (its result file
        was deleted); their object keys, for the caller to delete from the store."""
        rows = await self._rows(
            "DELETE FROM batch_segments WHERE batch_id = %(batch)s AND kind = %(kind)s RETURNING object_key",
            {"batch": batch_id, "kind": kind},
        )
        return sorted(key for (key,) in rows)

    async def known_batches(self) -> set[str]:
        """Every batch the ledger holds work of (running, cancelled or finished)."""
        return {batch for (batch,) in await self._rows("SELECT batch_id FROM batch_work")}

    async def holds_work(self) -> bool:
        """Whether any batch was ever handed to the ledger."""
        return bool(await self._rows("SELECT 1 FROM batch_work LIMIT 1"))

    async def cluster_id(self) -> str | None:
        """The id of the cluster this database belongs to, or None before one was recorded."""
        rows = await self._rows("SELECT cluster_id FROM batchgen_cluster")
        return str(rows[0][0]) if rows else None

    async def record_cluster_id(self, cluster_id: str) -> str:
        """Record ``cluster_id`` as the database's cluster unless it has one; the one it has now."""
        await self._rows(
            "INSERT INTO batchgen_cluster (cluster_id) VALUES (%(id)s) ON CONFLICT (only_row) DO NOTHING",
            {"id": cluster_id},
        )
        found = await self.cluster_id()
        assert found is not None  # inserted, or there already
        return found

    async def committed_keys(self) -> set[str]:
        """Every object key the manifest lists (what segment collection must keep)."""
        return {key for (key,) in await self._rows("SELECT object_key FROM batch_segments")}

    async def holders(self, batch_id: str) -> dict[str, int]:
        """Live leases of a batch per owner (who runs it now)."""
        rows = await self._rows(
            f"SELECT owner_id, count(*) FROM batch_shards WHERE batch_id = %(batch)s AND {_LIVE} GROUP BY owner_id",
            {"batch": batch_id},
        )
        return dict(rows)


async def renew_held(
    conn: AsyncConnection[Any], owner_id: str, ttl_s: float, held: Iterable[Lease]
) -> HeldRenewal:
    """Extend by ``ttl_s`` seconds the leases of ``held`` that are still ``owner_id``'s, live and
    of running batches, on a connection of the caller's (in autocommit mode), waiting for no
    lock: a shard a commit holds now is answered as ``busy``, not renewed."""
    _check_ttl(ttl_s)
    leases = list(held)
    cursor = await conn.execute(
        _RENEW_HELD,
        {
            "owner": owner_id,
            "ttl": ttl_s,
            "batches": [lease.batch_id for lease in leases],
            "shards": [lease.shard.shard_no for lease in leases],
            "epochs": [lease.epoch for lease in leases],
        },
    )
    renewed: dict[tuple[str, int], int] = {}
    busy: dict[tuple[str, int], int] = {}
    for batch, shard, epoch, extended in await cursor.fetchall():
        (renewed if extended else busy)[(batch, shard)] = epoch
    return HeldRenewal(renewed, busy)


def _check_ttl(ttl_s: float) -> None:
    if not (0 < ttl_s <= MAX_LEASE_S):
        raise ValueError(f"a lease lasts more than 0 and at most {MAX_LEASE_S:g} seconds, not {ttl_s!r}")


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {
        "batch": lease.batch_id,
        "shard": lease.shard.shard_no,
        "owner": lease.owner_id,
        "epoch": lease.epoch,
    }
