"""A replica runs only on a database and a blob store of one cluster, and never sweeps another's.

Over both stores (real files; a real SeaweedFS prefix) and a real PostgreSQL: the first start
makes the cluster and writes its id into both; a start on the same database with another folder or
prefix, or on another cluster's database with this store, is refused with a message naming both;
the half-made states a crash can leave (a marked store beside an unmarked database that holds
nothing) are finished instead; a store that cannot be written is refused. While a replica runs, a
store whose mark changes or goes away suspends its runner (unhealthy, nothing claimed) until the
mark is back. And the orphan sweep of a ledger deletes only segments of batches that ledger knows.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from batchgen.core.execution.cluster_identity import ClusterMismatch, ClusterWatch, establish_cluster
from batchgen.core.work.postgres_ledger import PostgresShardLedger
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.segment_store import CLUSTER_MARK_KEY, SegmentStore, segment_key
from batchgen.core.work.shard_runner import LineResult, ShardRunner, collect_orphans
from batchgen.core.work.shards import OUTPUT
from tests.core.segment_stores import StoreFactory
from tests.postgres import PostgresServer

pytestmark = pytest.mark.live


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _ledger(url: str) -> PostgresShardLedger:
    ledger = PostgresShardLedger(url)
    await ledger.open()
    await ledger.create_schema()
    return ledger


async def _establish(ledger: PostgresShardLedger, store: SegmentStore) -> str:
    return await establish_cluster(ledger, store, database="postgresql://db/x", blob=repr(store))


@pytest.mark.anyio
async def test_one_cluster_is_made_once_and_a_mixed_pair_is_refused(
    postgres_server: PostgresServer, new_store: StoreFactory
) -> None:
    home, elsewhere = new_store(), new_store()
    ledger = await _ledger(postgres_server.new_database())
    other_ledger = await _ledger(postgres_server.new_database())
    try:
        made = await _establish(ledger, home)
        assert home.cluster_mark() == made == await ledger.cluster_id()
        assert await _establish(ledger, home) == made  # every later start: the same cluster
        assert not list(home.keys())  # the probe left nothing behind
        await ledger.add_batch("batch_a", 3)
        # the cluster's database with another folder or prefix: refused, nothing written there
        with pytest.raises(ClusterMismatch, match=f"database belongs to cluster {made}.*no cluster mark"):
            await _establish(ledger, elsewhere)
        assert elsewhere.cluster_mark() is None
        # a database of its own (empty) on this cluster's store, once the store holds results
        home.write(segment_key("batch_a", OUTPUT, 0, 1, 0), b"{}\n")
        with pytest.raises(ClusterMismatch, match=f"store belongs to cluster {made}"):
            await _establish(other_ledger, home)
        assert await other_ledger.cluster_id() is None
        # another cluster's database (marked) with this store
        other_made = await _establish(other_ledger, elsewhere)
        with pytest.raises(ClusterMismatch, match=f"cluster {made} and the store to cluster {other_made}"):
            await _establish(ledger, elsewhere)
        with pytest.raises(ClusterMismatch, match=f"cluster {other_made} and the store to cluster {made}"):
            await _establish(other_ledger, home)
    finally:
        await ledger.close()
        await other_ledger.close()


@pytest.mark.anyio
async def test_the_half_made_states_of_a_crash_are_finished(
    postgres_server: PostgresServer, new_store: StoreFactory
) -> None:
    ledger = await _ledger(postgres_server.new_database())
    try:
        store = new_store()  # marked by a start that died before the database was
        marked = store.mark_cluster("cluster-left-by-a-crash")
        assert await _establish(ledger, store) == marked == await ledger.cluster_id()
        fresh = new_store()  # an empty store beside a database that holds no work yet
        assert await _establish(ledger, fresh) == marked == fresh.cluster_mark()
    finally:
        await ledger.close()


class _TornMark(SegmentFiles):
    """A folder store whose cluster mark is written in two steps, the file visible in between
    (as a filesystem shows it to a replica starting beside the writer): the first ``cut`` bytes,
    then, once another store read the mark (``mark_read``), the rest."""

    def __init__(self, root: Path, cut: int) -> None:
        super().__init__(root)
        self.cut = cut
        self.half_written = threading.Event()
        self.mark_read = threading.Event()

    def write(self, key: str, data: bytes) -> int:
        if key != CLUSTER_MARK_KEY:
            return super().write(key, data)
        with self._path(key).open("xb", buffering=0) as mark:
            mark.write(data[: self.cut])
            self.half_written.set()
            assert self.mark_read.wait(30), "no other start read the mark"
            mark.write(data[self.cut :])
        return len(data)


class _Reading(SegmentFiles):
    """A folder store that says when it has read the cluster mark."""

    def __init__(self, root: Path, mark_read: threading.Event) -> None:
        super().__init__(root)
        self.mark_read = mark_read

    def _read_whole(self, key: str) -> bytes | None:
        data = super()._read_whole(key)
        if key == CLUSTER_MARK_KEY and data is not None:
            self.mark_read.set()
        return data


@pytest.mark.anyio
@pytest.mark.parametrize("cut", [0, 1, 8, 24])
async def test_two_starts_on_an_empty_pair_make_one_cluster_when_one_reads_the_mark_half_written(
    postgres_server: PostgresServer, tmp_path: Path, cut: int
) -> None:
    """Two replicas start at once on an empty database and folder; the second reads the cluster
    mark while the first has written only ``cut`` bytes of it. Both run as the one cluster the
    first made, and the database records its whole id."""
    database = postgres_server.new_database()
    first_store = _TornMark(tmp_path, cut)
    first, second = await _ledger(database), await _ledger(database)
    try:
        making = asyncio.create_task(_establish(first, first_store))
        assert await asyncio.to_thread(first_store.half_written.wait, 30)
        joined = await _establish(second, _Reading(tmp_path, first_store.mark_read))
        made = await making
        assert joined == made == await first.cluster_id() == first_store.cluster_mark()
        assert made.startswith("cluster-") and len(made) >= cut
    finally:
        await first.close()
        await second.close()


@pytest.mark.anyio
async def test_a_mark_never_written_whole_is_refused_naming_it(
    postgres_server: PostgresServer, new_store: StoreFactory
) -> None:
    """A mark without its newline (a start that crashed while writing it) is waited for, then
    the start is refused with what the mark holds; the database records nothing."""
    store = new_store()
    store.mark_write_s = 0.3
    store.write(CLUSTER_MARK_KEY, b"cluster-torn")
    ledger = await _ledger(postgres_server.new_database())
    try:
        with pytest.raises(ClusterMismatch, match=r"cluster-torn.*no whole id"):
            await _establish(ledger, store)
        assert await ledger.cluster_id() is None
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_a_store_that_cannot_be_written_is_refused(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    store = SegmentFiles(tmp_path / "store")
    (tmp_path / "store" / "segments" / "probes").write_text("a file where a folder should be")
    ledger = await _ledger(postgres_server.new_database())
    try:
        with pytest.raises(ClusterMismatch, match="cannot be written, read back and deleted"):
            await _establish(ledger, store)
        assert await ledger.cluster_id() is None
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_a_store_swapped_under_a_running_replica_suspends_it_until_it_is_back(
    postgres_server: PostgresServer, new_store: StoreFactory
) -> None:
    store = new_store()
    ledger = await _ledger(postgres_server.new_database())
    try:
        made = await _establish(ledger, store)
        runner = ShardRunner(ledger, store, _never_run, replica_id="r1")
        watch = ClusterWatch(made, store, runner)
        assert await watch.check() and runner.healthy
        assert store._delete(CLUSTER_MARK_KEY)  # unmounted, or another prefix
        assert not await watch.check()
        assert not runner.healthy and "no cluster mark" in " ".join(runner.problems)
        store.write(CLUSTER_MARK_KEY, b"cluster-someone-else\n")
        assert not await watch.check()
        assert "cluster-someone-else" in " ".join(runner.problems)
        assert store._delete(CLUSTER_MARK_KEY)
        assert store.mark_cluster(made) == made
        assert await watch.check() and runner.healthy
    finally:
        await ledger.close()


async def _never_run(batch_id: str, line: int) -> LineResult:
    raise AssertionError("no line runs in this test")


@pytest.mark.anyio
async def test_a_ledger_sweeps_only_segments_of_the_batches_it_knows(
    postgres_server: PostgresServer, new_store: StoreFactory
) -> None:
    store = new_store()
    ledger = await _ledger(postgres_server.new_database())
    stranger = await _ledger(postgres_server.new_database())
    try:
        await ledger.add_batch("batch_mine", 2)
        mine = segment_key("batch_mine", OUTPUT, 0, 1, 0)
        theirs = segment_key("batch_theirs", OUTPUT, 0, 1, 0)
        store.write(mine, b"{}\n")
        store.write(theirs, b"{}\n")
        # a ledger that knows neither batch (another cluster's) deletes nothing, however old
        assert await collect_orphans(stranger, store, grace_s=-60) == 0
        # this one deletes its own uncommitted segment and leaves the unknown batch's alone
        assert await collect_orphans(ledger, store, grace_s=-60) == 1
        assert sorted(store.keys()) == [theirs]
    finally:
        await ledger.close()
        await stranger.close()
