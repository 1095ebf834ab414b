"""Real ``batchgen-server`` replicas through a PostgreSQL crash and an object store outage.

Three replicas on PostgreSQL and a real S3 server (SeaweedFS, started for the test so that it
can be stopped), the simulated backend at 0.5 s a request, a 3 s lease, and the ``openai`` SDK:

- PostgreSQL restarted with ``pg_ctl restart -m immediate`` mid-batch, and later crashed and
  kept down for twice the lease before it starts again: every replica reports itself
  ``unhealthy`` while the database is down, and the batch still ends ``completed`` with every
  custom_id exactly once and ``request_counts`` equal to the lines;
- the object store stopped for 10 s mid-batch, then started again on the same data: the same.

Through both, every committed segment is hashed when it appears and is unchanged at the end, and
a download of the output answers the committed bytes (each a prefix of the next) or 503, never
a 500.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.postgres import PostgresServer
from tests.replica_fleet import (
    Blobs,
    Fleet,
    SegmentHashes,
    client,
    create,
    downloads_grow,
    ended,
    every_line_once,
    running_fleet,
)
from tests.seaweedfs import SeaweedServer

pytestmark = pytest.mark.live

LEASE_S = 3.0
LINES = 12_000  # 3 replicas x 200 slots at 0.5 s a line: about 20 s of work


@pytest.fixture
def store() -> Iterator[SeaweedServer]:
    server = SeaweedServer.start()  # this test's own: it is stopped mid-run
    yield server
    server.stop()
    server.remove()


@pytest.fixture
def fleet(postgres_url: str, tmp_path: Path, store: SeaweedServer) -> Iterator[Fleet]:
    blobs = Blobs(store.url("outages"), store.environ)
    with running_fleet(postgres_url, tmp_path, blobs, lease_s=LEASE_S) as replicas:
        yield replicas


class _Unhealthy:
    """Which replicas said ``unhealthy`` on ``/health`` while the watch ran (polled 10 times a second)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self.said: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _Unhealthy:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            for name, health in self._fleet.health().items():
                if health["status"] == "unhealthy":
                    self.said.setdefault(name, str(health))


def _outage(
    fleet: Fleet, seconds: float, down: Callable[[], None], up: Callable[[], None], during: Callable[[], None]
) -> dict[str, str]:
    """``down()``, ``during()`` now and then for ``seconds``, then ``up()``; which replicas said
    they were unhealthy meanwhile, and what they said."""
    with _Unhealthy(fleet) as watch:
        down()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            during()
            time.sleep(1.0)
        up()
    return watch.said


def _finished_exactly_once(fleet: Fleet, batch: dict[str, Any], hashes: SegmentHashes) -> None:
    """After an outage, the batch ended with every line once, every segment hashed during the
    run unchanged, and every replica healthy again."""
    every_line_once(fleet, batch, LINES, "r")
    assert hashes.unchanged() >= LINES // 512
    assert all(health["status"] != "unhealthy" for health in fleet.health().values())


def test_a_postgres_crash_mid_batch_is_reported_then_ridden_out_exactly_once(
    fleet: Fleet, postgres_server: PostgresServer, tmp_path: Path
) -> None:
    batch_id = create(fleet.servers["a"], tmp_path / "input.jsonl", LINES, "r")
    seen: list[bytes] = []
    with SegmentHashes(fleet.url, fleet.blobs, batch_id) as hashes:
        time.sleep(3.0)
        postgres_server.restart()  # pg_ctl restart -m immediate
        time.sleep(2.0)
        said = _outage(fleet, 2 * LEASE_S, postgres_server.crash, postgres_server.resume, lambda: None)
        assert set(said) == set(fleet.servers), f"not every replica said it was unhealthy: {said}"
        batch = ended(fleet, batch_id, seen, 180)
    _finished_exactly_once(fleet, batch, hashes)


def test_an_object_store_down_for_10_s_mid_batch_is_reported_then_ridden_out_exactly_once(
    fleet: Fleet, store: SeaweedServer, tmp_path: Path
) -> None:
    batch_id = create(fleet.servers["b"], tmp_path / "input.jsonl", LINES, "r")
    seen: list[bytes] = []
    with SegmentHashes(fleet.url, fleet.blobs, batch_id) as hashes:
        time.sleep(4.0)
        output_file_id = client(fleet.any()).batches.retrieve(batch_id).output_file_id
        assert output_file_id is not None
        downloads_grow(fleet, output_file_id, seen)
        answers: list[int | None] = []
        said = _outage(
            fleet,
            10.0,
            store.stop,
            store.run,
            lambda: answers.append(downloads_grow(fleet, output_file_id, seen)),
        )
        assert 503 in answers, answers  # the committed bytes are in the store that is down
        assert set(said) == set(fleet.servers), f"not every replica said it was unhealthy: {said}"
        batch = ended(fleet, batch_id, seen, 180)
    _finished_exactly_once(fleet, batch, hashes)
