"""Which cluster a replica's database and blob store belong to, checked at start and while it runs.

A cluster is made once: the first replica to start on an empty database and an empty store mints
an id and writes it into the store first (``segments/cluster-id``) and then into the database
(``batchgen_cluster``). Every start after that reads both and refuses to run unless they name the
same cluster: a replica on the right database with another folder or S3 prefix would commit its
results where no other replica can read them, and a replica of another cluster pointed at this
store would treat this cluster's segments as its own. The store must also take a write, a read
and a delete (``SegmentStore.probe``).

Two half-made states are repaired instead of refused, because they hold nothing yet: a store that
was marked by a start that crashed before the database was (the database holds no work, the store
no segment), and an empty store beside a database that holds no work.

``ClusterWatch`` re-reads the store's mark while the replica runs: a store swapped or unmounted
under it suspends the runner (unhealthy, no claims, held shards let go) until the mark is back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from batchgen.core.errors import CannotStart
from batchgen.core.url_redaction import redact_url
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_store import SegmentStore
from batchgen.core.work.shard_runner import ShardRunner

__all__ = ["CLUSTER_CHECK_EVERY_S", "ClusterMismatch", "ClusterWatch", "establish_cluster"]

#: How often a running replica reads its store's cluster mark again.
CLUSTER_CHECK_EVERY_S = 5.0

logger = logging.getLogger(__name__)


class ClusterMismatch(CannotStart):
    """The database and the blob store are not one cluster's, or the store cannot be used."""


def _refusal(database: str, store: str, what: str) -> ClusterMismatch:
    return ClusterMismatch(
        f"This replica's database ({redact_url(database)}) and blob store ({redact_url(store)}) are "
        f"not one cluster's: {what} Every replica of a cluster must be given the same --metadata-url "
        "and the same --blob-url; running on this pair would write results where the other "
        "replicas cannot read them, or delete theirs. Nothing was changed."
    )


async def establish_cluster(
    ledger: PostgresShardLedger, store: SegmentStore, *, database: str, blob: str
) -> str:
    """The id of the cluster both the database and the store belong to, made if neither has one;
    ClusterMismatch saying which is which when they disagree or the store cannot be used."""
    try:
        await asyncio.to_thread(store.probe)
        marked = await asyncio.to_thread(store.cluster_mark)
    except OSError as error:
        raise ClusterMismatch(
            f"This replica's blob store ({redact_url(blob)}) cannot be written, read back and "
            f"deleted from: {error}. Check the --blob-url, its credentials and its permissions."
        ) from None
    recorded = await ledger.cluster_id()
    if marked is not None and marked == recorded:
        return marked
    if marked is not None and recorded is not None:
        raise _refusal(
            database, blob, f"the database belongs to cluster {recorded} and the store to cluster {marked}."
        )
    database_empty = not await ledger.holds_work()
    store_empty = not await asyncio.to_thread(store.holds_segments)
    if recorded is not None:  # the store has no mark
        if not (database_empty and store_empty):
            raise _refusal(
                database,
                blob,
                f"the database belongs to cluster {recorded}, and the store has no cluster mark "
                "(it is another folder or prefix than the cluster's).",
            )
        marked = await asyncio.to_thread(store.mark_cluster, recorded)
        if marked != recorded:  # another replica marked it meanwhile, for another cluster
            raise _refusal(
                database, blob, f"the database belongs to cluster {recorded} and the store to {marked}."
            )
        return recorded
    if marked is not None:  # the database has no cluster yet
        if not (database_empty and store_empty):
            raise _refusal(
                database,
                blob,
                f"the store belongs to cluster {marked}, and the database records no cluster but "
                + ("holds work of its own." if not database_empty else "the store holds its results."),
            )
    else:
        marked = await asyncio.to_thread(store.mark_cluster, f"cluster-{secrets.token_hex(8)}")
    recorded = await ledger.record_cluster_id(marked)
    if recorded != marked:
        raise _refusal(
            database, blob, f"the database belongs to cluster {recorded} and the store to {marked}."
        )
    logger.info("this replica's database and blob store are cluster %s", marked)
    return marked


class ClusterWatch:
    """Reads the store's cluster mark every ``every_s`` and suspends ``runner`` while it is not
    ``cluster_id`` (or cannot be read)."""

    PART = "blob store"

    def __init__(
        self,
        cluster_id: str,
        store: SegmentStore,
        runner: ShardRunner,
        every_s: float = CLUSTER_CHECK_EVERY_S,
    ) -> None:
        self.cluster_id = cluster_id
        self.store = store
        self.runner = runner
        self.every_s = every_s

    async def check(self) -> bool:
        """Read the mark once: resume the runner if it is this cluster's, else suspend it."""
        try:
            marked = await asyncio.to_thread(self.store.cluster_mark)
        except OSError as error:
            problem = f"its cluster mark cannot be read ({error})"
        else:
            if marked == self.cluster_id:
                self.runner.resume(self.PART)
                return True
            problem = "it has no cluster mark any more" if marked is None else f"it is cluster {marked}'s now"
        self.runner.suspend(
            self.PART, f"the blob store is not cluster {self.cluster_id}'s: {problem}; no line runs here"
        )
        return False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self.check()
