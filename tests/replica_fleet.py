"""Real ``batchgen-server`` replicas for the failure tests, and what those tests check of them.

``Fleet`` (``running_fleet``: started, and stopped at the end) starts replicas by name on one PostgreSQL database and one blob store (a shared folder
or an S3 prefix), the simulated backend at ``latency_s`` a request and ``slots`` lines each, and
kills, restarts and reports on them. ``SegmentHashes`` watches a batch's committed segments from
outside (the manifest in PostgreSQL, the objects in the store), hashing each one when it first
appears; ``unchanged`` then checks every one of them against the store at the end. The check
helpers assert what every failure test asserts: every custom_id exactly once, ``request_counts``
equal to the lines, and each download of the output a prefix of every later one.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import psycopg
from openai import OpenAI

from batchgen.core.work.segment_store import open_segment_store
from batchgen.core.work.shards import Segment
from tests.helpers import chat_line, jsonl
from tests.live import LiveServer, launch_server, stop_servers


@attrs.frozen
class Blobs:
    """Where a fleet keeps file contents: ``file://`` a shared folder, or ``s3://`` a prefix."""

    url: str
    environ: dict[str, str] = attrs.field(factory=dict)


def start_replica(
    root: Path, url: str, blobs: Blobs, name: str, *flags: str, lease_s: float = 3.0
) -> LiveServer:
    """A ``batchgen-server`` replica named ``name`` on the database at ``url`` and on ``blobs``,
    its storage folder ``root / name``, with ``flags`` added, once /health answers 200."""
    server = launch_replica(root, url, blobs, name, *flags, lease_s=lease_s)
    server.wait_ready()
    return server


def launch_replica(
    root: Path, url: str, blobs: Blobs, name: str, *flags: str, lease_s: float = 3.0
) -> LiveServer:
    """``start_replica`` without the wait (``LiveServer.wait_ready``): replicas launched together
    start together, as a deployment's do, and make the schema under its advisory lock."""
    return launch_server(
        root / name,
        "--metadata-url",
        url,
        "--blob-url",
        blobs.url,
        "--replica-id",
        name,
        "--lease-s",
        f"{lease_s:g}",
        *flags,
        environ=blobs.environ,
    )


@contextmanager
def running_replicas(
    root: Path, url: str, blobs: Blobs, names: tuple[str, ...], *flags: str, lease_s: float = 3.0
) -> Iterator[list[LiveServer]]:
    """A replica for each of ``names``, started together, all stopped together at the end."""
    servers: list[LiveServer] = []
    try:
        for name in names:
            servers.append(launch_replica(root, url, blobs, name, *flags, lease_s=lease_s))
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        stop_servers(servers)


class Fleet:
    """Replicas by name, started and restarted on one database and one blob store."""

    def __init__(
        self, url: str, root: Path, blobs: Blobs, *, lease_s: float, latency_s: float = 0.5, slots: int = 200
    ) -> None:
        self.url, self.root, self.blobs = url, root, blobs
        self.lease_s, self.latency_s, self.slots = lease_s, latency_s, slots
        self.servers: dict[str, LiveServer] = {}

    def start(self, name: str) -> LiveServer:
        """Start the replica ``name`` and wait until it is healthy."""
        return self.start_together(name)[0]

    def start_together(self, *names: str) -> list[LiveServer]:
        """Start the replicas ``names`` at once, then wait until each is healthy."""
        for name in names:
            self.servers[name] = self._launch(name)
        for name in names:
            self.servers[name].wait_ready()
        return [self.servers[name] for name in names]

    def _launch(self, name: str) -> LiveServer:
        return launch_replica(
            self.root,
            self.url,
            self.blobs,
            name,
            "--max-pool-size",
            str(self.slots),
            "--simulated-latency-s",
            str(self.latency_s),
            lease_s=self.lease_s,
        )

    def kill(self, name: str) -> None:
        process = self.servers[name].process
        process.send_signal(signal.SIGKILL)
        process.wait()

    def busiest(self) -> str:
        """The running replica holding the most shards now."""
        held = {name: report(server)["shards_held"] for name, server in self.servers.items()}
        return max(held, key=lambda name: held[name])

    def any(self) -> LiveServer:
        return random.choice(list(self.servers.values()))

    def health(self) -> dict[str, dict[str, Any]]:
        """Each replica's ``/health`` now."""
        return {
            name: httpx.get(f"{server.base_url}/health", timeout=10).json()
            for name, server in self.servers.items()
        }

    def stop(self) -> None:
        stop_servers(self.servers.values())


@contextmanager
def running_fleet(
    url: str, root: Path, blobs: Blobs, *, lease_s: float, names: tuple[str, ...] = ("a", "b", "c")
) -> Iterator[Fleet]:
    """A fleet with the replicas ``names`` started, stopped at the end whatever happened."""
    fleet = Fleet(url, root, blobs, lease_s=lease_s)
    try:
        fleet.start_together(*names)
        yield fleet
    finally:
        fleet.stop()


def report(server: LiveServer) -> dict[str, Any]:
    """The ``replica`` block of a replica's ``/health``."""
    return dict(httpx.get(f"{server.base_url}/health", timeout=10).json()["replica"])


def committed_once(servers: Mapping[str, LiveServer], lines: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """The replicas' ``/health`` reports, by name, once their ``lines_committed`` add up to exactly
    ``lines``. A replica counts a commit when its loop reads the database's answer, which can come
    after the batch was seen completed elsewhere; a sum over ``lines`` fails at once, one that
    stays short fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        reports = {name: report(server) for name, server in servers.items()}
        committed = sum(r["lines_committed"] for r in reports.values())
        assert committed <= lines, reports
        if committed == lines:
            return reports
        assert time.monotonic() < deadline, reports
        time.sleep(0.2)


def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.api_url, api_key="unused", max_retries=5)


def create(server: LiveServer, path: Path, lines: int, prefix: str) -> str:
    """Upload ``lines`` requests (custom_ids ``prefix0``, ...) and create a batch of them."""
    path.write_bytes(jsonl(*(chat_line(f"{prefix}{i}") for i in range(lines))))
    uploaded = client(server).files.create(file=path.open("rb"), purpose="batch")
    batch = client(server).batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def downloads_grow(fleet: Fleet, file_id: str | None, seen: list[bytes]) -> int | None:
    """Download the output from a random replica; it must extend what was downloaded before (or
    be a 503, while a store is down). The status, None for no file yet."""
    if file_id is None:
        return None
    answer = httpx.get(f"{fleet.any().api_url}/files/{file_id}/content", timeout=30)
    assert answer.status_code in (200, 503), answer.text  # never a 500, never a response cut off
    if answer.status_code == 503:
        return 503
    now = answer.content
    assert not seen or now.startswith(seen[-1]), "committed bytes changed, or uncommitted ones were served"
    seen.append(now)
    return 200


def ended(fleet: Fleet, batch_id: str, seen: list[bytes], timeout_s: float) -> dict[str, Any]:
    """The batch once it has ended, downloading its output now and then meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client(fleet.any()).batches.retrieve(batch_id).model_dump()
        downloads_grow(fleet, batch["output_file_id"], seen)
        if batch["status"] not in ("validating", "in_progress", "finalizing"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)


def every_line_once(fleet: Fleet, batch: dict[str, Any], lines: int, prefix: str) -> None:
    assert batch["status"] == "completed", batch
    output = httpx.get(f"{fleet.any().api_url}/files/{batch['output_file_id']}/content", timeout=60).content
    ids = Counter(json.loads(line)["custom_id"] for line in output.splitlines())
    assert ids == Counter(f"{prefix}{i}" for i in range(lines))
    counts = batch["request_counts"]
    assert (counts["completed"], counts["failed"], counts["total"]) == (lines, 0, lines)


class SegmentHashes:
    """A batch's committed segments, each hashed when first seen (see the module)."""

    def __init__(self, database_url: str, blobs: Blobs, batch_id: str) -> None:
        self._url, self._batch_id = database_url, batch_id
        self._store = open_segment_store(blobs.url, blobs.environ)
        self.hashes: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> SegmentHashes:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _committed(self) -> list[Segment]:
        with psycopg.connect(self._url, connect_timeout=2) as connection:
            rows = connection.execute(
                "SELECT batch_id, kind, shard_no, seq, epoch, object_key, size, lines FROM batch_segments "
                "WHERE batch_id = %s ORDER BY seq",
                (self._batch_id,),
            ).fetchall()
        return [
            Segment(b, k, shard, seq, epoch, key, size, tuple(lines))
            for b, k, shard, seq, epoch, key, size, lines in rows
        ]

    def _digest(self, segment: Segment) -> str:
        return hashlib.sha256(b"".join(self._store.read([segment]))).hexdigest()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:  # the database or the store may be down on purpose: try again next time
                for segment in self._committed():
                    if segment.object_key not in self.hashes:
                        self.hashes[segment.object_key] = self._digest(segment)
            except Exception:  # an outage the test made: the next look catches up
                continue

    def unchanged(self) -> int:
        """Check every segment hashed during the run against the store now; how many there were."""
        committed = {segment.object_key: segment for segment in self._committed()}
        assert set(self.hashes) <= set(committed), "a segment seen committed left the manifest"
        for key, digest in self.hashes.items():
            assert self._digest(committed[key]) == digest, f"committed segment {key} changed"
        return len(self.hashes)
