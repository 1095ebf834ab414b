"""Real replicas serve an ended ``output_order: "input"`` batch in input order, the same from each.

Two ``batchgen-server`` processes on one PostgreSQL and one blob store (a shared folder, then a
real S3 server), ``--output-order input`` their default and the simulated backend: a batch of
several shards (run side by side in a small pool, its later lines shorter: committed
interleaved, later lines first) created on one replica without
``output_order`` ends ``completed`` with
``output_order: "input"``, and every replica serves its output with the custom_ids in input
order, byte for byte the same, with the same ``Content-Length`` and file ``bytes``, and any
``Range`` of it the same slice from each; a batch created with ``output_order: "completion"``
keeps the order its segments were committed in.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from openai import OpenAI

from batchgen.core.work.segment_store import open_segment_store
from batchgen.core.work.shards import Segment
from tests.helpers import chat_line, jsonl
from tests.live import LiveServer
from tests.replica_fleet import Blobs, running_replicas

pytestmark = pytest.mark.live

LINES = 1300  # three shards


@pytest.fixture
def two(postgres_url: str, tmp_path: Path, blobs: Blobs) -> Iterator[list[LiveServer]]:
    with running_replicas(
        tmp_path,
        postgres_url,
        blobs,
        ("a", "b"),
        "--simulated-latency-s",
        "0.002",
        "--simulated-token-latency-s",
        "0.004",
        "--output-order",
        "input",
        # a few lines at once, shared fairly by the shards held: the shards run side by side
        # and each commits in several segments, so commit order interleaves them whatever the
        # load (with every line at once, a loaded replica may end and commit shard after shard)
        "--max-pool-size",
        "64",
    ) as servers:
        yield servers


def _lines() -> list[dict]:
    """The requests, each later one shorter: with a latency per token, and the shards sharing the
    pool's slots fairly, the last shard's lines finish (and are committed) first and the shards'
    segments interleave, so commit order is not input order."""
    return [
        chat_line(f"r{i}", f"question {i}", max_tokens=1 + (LINES - 1 - i) * 40 // LINES)
        for i in range(LINES)
    ]


def _client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.api_url, api_key="unused", max_retries=2)


def _ended(client: OpenAI, batch_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id).model_dump())["status"] not in (
        "completed",
        "failed",
        "cancelled",
        "expired",
    ):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def _content(server: LiveServer, file_id: str, byte_range: str | None = None) -> httpx.Response:
    headers = {} if byte_range is None else {"Range": byte_range}
    return httpx.get(f"{server.api_url}/files/{file_id}/content", headers=headers, timeout=60)


def _commit_order(url: str, blobs: Blobs, batch_id: str) -> bytes:
    """The batch's committed output segments read end to end in commit order, from outside."""
    with psycopg.connect(url) as connection:
        rows = connection.execute(
            "SELECT batch_id, kind, shard_no, seq, epoch, object_key, size, lines FROM batch_segments "
            "WHERE batch_id = %s AND kind = 'output' ORDER BY seq",
            (batch_id,),
        ).fetchall()
    segments = [Segment(b, k, s, q, e, key, size, tuple(lines)) for b, k, s, q, e, key, size, lines in rows]
    return b"".join(open_segment_store(blobs.url, blobs.environ).read(segments))


def test_every_replica_serves_an_ended_input_order_batch_in_input_order(
    two: list[LiveServer], tmp_path: Path, postgres_url: str, blobs: Blobs
) -> None:
    uploads = []
    for name in ("ordered", "as-finished"):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(jsonl(*_lines()))
        uploads.append(_client(two[0]).files.create(file=path.open("rb"), purpose="batch"))
    ordered = _client(two[0]).batches.create(
        input_file_id=uploads[0].id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    as_finished = _client(two[1]).batches.create(
        input_file_id=uploads[1].id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"output_order": "completion"},
    )
    ended = _ended(_client(two[1]), ordered.id)
    assert ended["status"] == "completed" and ended["output_order"] == "input"
    assert _client(two[0]).batches.retrieve(ordered.id).model_dump() == ended

    answers = [_content(server, ended["output_file_id"]) for server in two]
    output = answers[0].content
    assert all(answer.status_code == 200 and answer.content == output for answer in answers)
    assert {answer.headers["content-length"] for answer in answers} == {str(len(output))}
    ids = [json.loads(line)["custom_id"] for line in output.splitlines()]
    assert ids == [f"r{i}" for i in range(LINES)]
    committed = _commit_order(postgres_url, blobs, ordered.id)
    assert committed != output and sorted(committed.splitlines()) == sorted(output.splitlines())
    for server in two:
        assert _client(server).files.retrieve(ended["output_file_id"]).bytes == len(output)
    rng = random.Random(ordered.id)
    for _ in range(4):
        start = rng.randrange(len(output))
        stop = rng.randrange(start, len(output))
        parts = [_content(server, ended["output_file_id"], f"bytes={start}-{stop}") for server in two]
        for part in parts:
            assert part.status_code == 206 and part.content == output[start : stop + 1]
            assert part.headers["content-range"] == f"bytes {start}-{stop}/{len(output)}"
    tail = [_content(server, ended["output_file_id"], "bytes=-100") for server in two]
    assert all(part.status_code == 206 and part.content == output[-100:] for part in tail)

    other = _ended(_client(two[0]), as_finished.id)
    assert other["status"] == "completed" and other["output_order"] == "completion"
    unordered = [_content(server, other["output_file_id"]).content for server in two]
    assert unordered[0] == unordered[1] == _commit_order(postgres_url, blobs, as_finished.id)
