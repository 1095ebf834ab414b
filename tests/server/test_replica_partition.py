"""A real ``batchgen-server`` replica cut off from PostgreSQL past its lease, then healed.

Three replicas on one PostgreSQL and a shared folder; the third runs in a network namespace
(``tests.netns``), reaching PostgreSQL over a veth pair (the database also listens on the host
end) and serving its API on the namespace's end. Once it holds shards of a 12,000-line batch,
the pair is cut (packets dropped: its calls hang, they do not fail) for twice the lease. The
other two take its shards over meanwhile, and the batch goes on without it; healed, the cut
replica reports the leases it lost, and the batch ends with every custom_id exactly once,
``request_counts`` equal to the lines, and the replicas' committed lines adding up to the batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.live import LiveServer, start_server
from tests.netns import Namespace
from tests.postgres import PostgresServer
from tests.replica_fleet import Blobs, committed_once, create, ended, every_line_once, report, running_fleet

pytestmark = pytest.mark.live

LEASE_S = 3.0
LINES = 12_000


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    made = Namespace.create()
    yield made
    made.remove()


@pytest.fixture
def database(namespace: Namespace) -> Iterator[PostgresServer]:
    server = PostgresServer.start(also_listen=(namespace.host_ip,))
    yield server
    server.stop()
    server.remove()


def _live_leases(url: str, owner: str) -> int:
    with psycopg.connect(url, connect_timeout=5) as db:
        row = db.execute(
            "SELECT count(*) FROM batch_shards WHERE owner_id = %s AND state = 'leased' "
            "AND lease_expires_at > clock_timestamp()",
            (owner,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_replica_cut_off_from_postgres_past_its_lease_loses_its_shards_and_no_line_doubles(
    namespace: Namespace, database: PostgresServer, tmp_path: Path
) -> None:
    url = database.new_database()
    blobs = Blobs(f"file://{tmp_path / 'shared'}")
    with running_fleet(url, tmp_path, blobs, lease_s=LEASE_S, names=("a", "b")) as fleet:
        inside_url = database.url(url.rsplit("/", 1)[1], host=namespace.host_ip)
        cut: LiveServer = start_server(
            tmp_path / "cut",
            "--metadata-url",
            inside_url,
            "--blob-url",
            fleet.blobs.url,
            "--replica-id",
            "cut",
            "--lease-s",
            str(LEASE_S),
            "--max-pool-size",
            "200",
            "--simulated-latency-s",
            "0.5",
            host=namespace.guest_ip,
            wrap=lambda command: namespace.command(*command),
        )
        fleet.servers["cut"] = cut
        batch_id = create(fleet.servers["a"], tmp_path / "input.jsonl", LINES, "r")
        owner = report(cut)["owner"]
        deadline = time.monotonic() + 60
        while report(cut)["shards_held"] == 0:
            assert time.monotonic() < deadline, "the replica in the namespace never held a shard"
            time.sleep(0.1)
        namespace.cut()
        try:
            time.sleep(2 * LEASE_S + 1)
            assert _live_leases(url, owner) == 0, "the cut replica still holds leases"
            others = [report(fleet.servers[name])["lines_committed"] for name in ("a", "b")]
            time.sleep(1.0)
            assert [report(fleet.servers[name])["lines_committed"] for name in ("a", "b")] != others
        finally:
            namespace.heal()
        batch = ended(fleet, batch_id, [], 180)
        every_line_once(fleet, batch, LINES, "r")
        reports = committed_once(fleet.servers, LINES)
        assert reports["cut"]["leases_lost"] >= 1, reports["cut"]
