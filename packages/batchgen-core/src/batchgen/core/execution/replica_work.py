"""One replica's share of the work, when several replicas share a database and a blob store.

``ReplicaWork`` is what a ``BatchService`` runs in that mode, instead of resuming batches of its
own: the ledger (``PostgresShardLedger``), the ``SharedBatches`` its calls answer through, and a
``ShardRunner`` that claims shards of any replica's batches and runs their lines with a
``LineRunner`` on this replica's models, as many at once as the service has slots
(``--max-pool-size``: thousands, enough to keep a GPU engine full), holding enough shards to fill
them. The event loop carries every line in flight, so nothing that keeps the leases waits on it:
the renewals come from a thread of their own (``work.lease_heartbeat``), and the ledger's pool has
a connection for each held shard's commit (up to ``LEDGER_COMMIT_CONNECTIONS``) besides the
claims and reads. ``run`` works
until ``stop``, which lets the leases go at once so another replica takes them without waiting for
them to run out; meanwhile every replica saves its report (``report``: its share of the work) in
the ledger and reads everyone's (``fleet``), which the pool status and the dashboard show, and
deletes, once an hour, the segments of replicas that died or were fenced out before committing
them (older than ``ORPHAN_GRACE_S``, never served). A replica whose last report is older than two
report intervals (``fleet_status``: it missed two, or this replica could not read them for that
long) is listed as not reporting and not healthy, until it drops out of the list.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from batchgen.core.backends.served_models import ModelSet
from batchgen.core.batches.shared_batches import SharedBatches
from batchgen.core.execution.cluster_identity import ClusterWatch, establish_cluster
from batchgen.core.execution.replica_lines import LineRunner
from batchgen.core.execution.shared_storage import SharedStorage
from batchgen.core.files.batch_inputs import BatchInputs
from batchgen.core.requests.parameters import ServerDefaults
from batchgen.core.storage import BlobStore, MetadataStore
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.webhook_outbox import WebhookTargets
from batchgen.core.work.intake import IntakeLimits
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_store import open_segment_store
from batchgen.core.work.shard_runner import ORPHAN_GRACE_S, ShardRunner, collect_orphans
from batchgen.core.work.shards import SHARD_LINES

__all__ = ["ReplicaWork"]
#: The most of the ledger's connections a replica's commits use at once (one per held shard up to
#: this): more shards than that take turns, and claims always find a connection of their own.
LEDGER_COMMIT_CONNECTIONS = 16
#: How often a replica saves its report for the others and reads theirs.
REPORT_EVERY_S = 2.0
#: Reports a replica may miss before it is listed as not reporting (``fleet_status``).
MISSED_REPORTS = 2
#: How often a replica deletes the segments no commit lists (``work.shard_runner.collect_orphans``).
COLLECT_EVERY_S = 3600.0

logger = logging.getLogger(__name__)


def fleet_status(
    reports: Sequence[dict[str, Any]], *, read_at: float, now: float, every_s: float = REPORT_EVERY_S
) -> list[dict[str, Any]]:
    """The replicas' reports as ``/v1/pool/status`` and the dashboard list them at ``now``: read
    from the ledger at ``read_at`` (the same clock), each with its ``seen_s_ago`` then.

    Each gets its age now (``seen_s_ago``: its age when read plus the time since) and
    ``reporting``: False once it is known to have missed ``MISSED_REPORTS`` reports, that is when
    it was already older than that many intervals when read, or when this replica has not read the
    reports for that long (it cannot tell who still reports). A replica not reporting is not
    healthy either, whatever its last report said."""
    limit_s = MISSED_REPORTS * every_s
    since_read = max(0.0, now - read_at)
    listed = []
    for report in reports:
        age = max(0.0, float(report.get("seen_s_ago", 0.0)))
        reporting = age <= limit_s and since_read <= limit_s
        listed.append(
            {
                **report,
                "seen_s_ago": round(age + since_read, 1),
                "reporting": reporting,
                "healthy": reporting and bool(report.get("healthy")),
            }
        )
    return listed


class ReplicaWork:
    """The ledger, the shared batches and the shard runner of one replica (see the module)."""

    def __init__(
        self,
        shared: SharedStorage,
        metadata: MetadataStore,
        calls: MetadataCalls,
        models: ModelSet,
        blobs: BlobStore,
        *,
        defaults: ServerDefaults,
        max_attempts: int,
        separate_error_file: bool,
        intake_capacity: int | None,
        slots: int,
        webhooks: WebhookTargets | None = None,
    ) -> None:
        """``slots``: the lines this replica runs at once over all its shards (``--max-pool-size``),
        with enough shards held to fill them."""
        slots = max(1, slots)
        self.shared = shared
        self.replica_id = shared.replica_id
        #: The cluster the database and the store belong to, once ``open`` checked them.
        self.cluster_id: str | None = None
        #: Every live replica's last report (this one's included), read from the ledger every
        #: ``REPORT_EVERY_S`` (at ``_read_at``, on the monotonic clock): ``fleet`` lists them.
        self._reports: list[dict[str, Any]] = []
        self._read_at = time.monotonic()
        #: How often this replica deletes orphaned segments, and how old they must be.
        self.collect_every_s = COLLECT_EVERY_S
        self.orphan_grace_s = ORPHAN_GRACE_S
        self.orphans_collected = 0
        max_shards = max(shared.max_shards, -(-slots // SHARD_LINES) + 1)
        # a commit per held shard at once (up to 16) and room for the claims and reads beside them
        self.ledger = PostgresShardLedger(
            shared.metadata_url, max_connections=min(max_shards, LEDGER_COMMIT_CONNECTIONS) + 4
        )
        self.segments = open_segment_store(shared.blob_url)
        self.batches = SharedBatches(
            metadata,
            self.ledger,
            self.segments,
            calls=calls,
            limits=IntakeLimits(capacity=intake_capacity),
            openai_convention=separate_error_file,
            webhooks=webhooks,
        )
        self.inputs = BatchInputs(metadata, calls, readable=blobs.readable)
        lines = LineRunner(
            models,
            self.inputs,
            defaults=defaults,
            max_attempts=max_attempts,
            separate_error_file=separate_error_file,
        )
        self.runner = ShardRunner(
            self.ledger,
            self.segments,
            lines,
            replica_id=shared.replica_id,
            max_shards=max_shards,
            concurrency=slots,
            ttl_s=shared.lease_s,
        )

    async def open(self) -> None:
        """Connect to the ledger, make its tables (idempotent: every replica does it) and check
        that the database and the blob store are one cluster's (``ClusterMismatch`` otherwise)."""
        await self.ledger.open()
        try:
            await self.ledger.create_schema()
            self.cluster_id = await establish_cluster(
                self.ledger, self.segments, database=self.shared.metadata_url, blob=self.shared.blob_url
            )
        except BaseException:
            await self.ledger.close()
            raise

    async def run(self) -> None:
        """Run shards until ``stop``; the unfinished ones are released then. Meanwhile, share
        this replica's report with the others and read theirs (``fleet``)."""
        helpers = [
            asyncio.create_task(self._share_reports(), name=f"{self.replica_id}-reports"),
            asyncio.create_task(self._collect_orphans(), name=f"{self.replica_id}-orphans"),
        ]
        if self.cluster_id is not None:
            watch = ClusterWatch(self.cluster_id, self.segments, self.runner)
            helpers.append(asyncio.create_task(watch.run(), name=f"{self.replica_id}-cluster"))
        try:
            await self.runner.run()
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    async def _collect_orphans(self) -> None:
        """Every ``collect_every_s`` (the first time at a random point of the first interval, so
        replicas started together do not list the store together): delete the segments no commit
        lists that are older than ``orphan_grace_s``, written by replicas that died or were fenced
        out before committing. Never served, so any replica may delete them."""
        await asyncio.sleep(random.uniform(0, self.collect_every_s))
        while True:
            try:
                deleted = await collect_orphans(self.ledger, self.segments, self.orphan_grace_s)
            except Exception:  # the store or the database is away: the next round tries again
                logger.warning("%s could not collect orphaned segments", self.replica_id, exc_info=True)
            else:
                self.orphans_collected += deleted
                if deleted:
                    logger.info("%s deleted %d orphaned segments", self.replica_id, deleted)
            await asyncio.sleep(self.collect_every_s)

    async def _share_reports(self) -> None:
        """Every ``REPORT_EVERY_S``: save this replica's report in the ledger and read every
        live replica's (reports older than three leases are of replicas gone)."""
        while True:
            try:
                await self.ledger.report_replica(self.runner.owner_id, self.replica_id, self.report())
                self._reports = await self.ledger.replica_reports(3 * self.runner.ttl_s)
                self._read_at = time.monotonic()
            except Exception:  # the ledger is away: the runner reports that in the health
                logger.debug("%s could not share its report", self.replica_id, exc_info=True)
            await asyncio.sleep(REPORT_EVERY_S)

    @property
    def fleet(self) -> list[dict[str, Any]]:
        """Every live replica's last report as of now, with whether it still reports
        (``fleet_status``): what ``/v1/pool/status`` and the dashboard list."""
        return fleet_status(self._reports, read_at=self._read_at, now=time.monotonic())

    def stop(self) -> None:
        self.runner.stop()

    def report(self) -> dict[str, object]:
        """What ``/health`` says of this replica's share of the work."""
        runner = self.runner
        return {
            "id": self.replica_id,
            "cluster": self.cluster_id,
            "owner": runner.owner_id,
            "healthy": runner.healthy,
            "shards_held": len(runner.held),
            "lines_committed": runner.lines_committed,
            "leases_lost": runner.leases_lost,
            "shards_cancelled": runner.shards_cancelled,
            "commits_refused": runner.commits_refused,
            "problems": runner.problems,
        }

    async def close(self) -> None:
        self.inputs.close()
        await self.ledger.close()
