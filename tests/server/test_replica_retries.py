"""Retries and merged results of shared batches, on real replicas: any replica serves them.

Three real ``batchgen-server`` replicas on one PostgreSQL and one blob store (a shared folder, or
SeaweedFS over S3), the simulated backend failing most attempts: a batch made on one replica and
ended is retried on another (its retry's input file holds exactly the failed lines, in input
order, and every replica serves it), the merged view of the batch and its retry is the same from
every replica and holds every request once, in input order, the better outcome winning; two
replicas asked at once for a retry of one batch make one retry batch; the same
``Idempotency-Key`` sent to two replicas at once answers the same retry batch. A batch is created
on a replica that has no copy of its input file (an object store's file, uploaded elsewhere).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import chat_line, jsonl
from tests.replica_fleet import Blobs, running_replicas

pytestmark = pytest.mark.live

TERMINAL = {"completed", "failed", "cancelled", "expired"}


@contextmanager
def _failing_fleet(url: str, root: Path, blobs: Blobs, latency_s: float) -> Iterator[list[httpx.Client]]:
    """Three replicas whose attempts fail two times in three (about 30% of lines fail, their
    attempts spent)."""
    flags = ("--simulated-failure-rate", "0.67", "--simulated-latency-s", str(latency_s))
    with running_replicas(root, url, blobs, ("a", "b", "c"), *flags) as servers:
        clients = [httpx.Client(base_url=server.base_url, timeout=60) for server in servers]
        try:
            yield clients
        finally:
            for client in clients:
                client.close()


@pytest.fixture
def failing(postgres_url: str, tmp_path: Path, blobs: Blobs) -> Iterator[list[httpx.Client]]:
    with _failing_fleet(postgres_url, tmp_path, blobs, 0.01) as clients:
        yield clients


@pytest.fixture
def slow_failing(postgres_url: str, tmp_path: Path, blobs: Blobs) -> Iterator[list[httpx.Client]]:
    """As ``failing``, each attempt that succeeds taking three seconds (a failed one fails at
    once): a retry batch runs for a while, longer than replicas asked at once, one at a time
    under the lock they share, take to answer on a loaded machine."""
    with _failing_fleet(postgres_url, tmp_path, blobs, 3.0) as clients:
        yield clients


def _ended(client: httpx.Client, batch_id: str, timeout_s: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in TERMINAL:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


def _lines(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.content.splitlines()]


def _succeeded(line: dict[str, Any]) -> bool:
    return (
        line.get("error") is None and line["response"] is not None and line["response"]["status_code"] < 400
    )


def _run(client: httpx.Client, lines: int, prefix: str = "r") -> tuple[list[str], dict[str, Any]]:
    ids = [f"{prefix}{i}" for i in range(lines)]
    uploaded = client.post(
        "/v1/files",
        files={"file": ("in.jsonl", jsonl(*(chat_line(custom_id, f"q {custom_id}") for custom_id in ids)))},
        data={"purpose": "batch"},
    )
    assert uploaded.status_code == 200, uploaded.text
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert created.status_code == 200, created.text
    return ids, created.json()


def test_a_shared_batch_is_retried_and_merged_on_any_replica(failing: list[httpx.Client]) -> None:
    a, b, c = failing
    ids, batch = _run(a, 1200)
    ended = _ended(b, batch["id"])
    assert ended["status"] == "completed"
    first = _lines(c, ended["output_file_id"]) + _lines(c, ended["error_file_id"])
    failed = {line["custom_id"] for line in first if not _succeeded(line)}
    assert Counter(line["custom_id"] for line in first) == Counter(ids)
    assert 0 < len(failed) < len(ids)  # the simulated failures: some, not all

    response = c.post(f"/v1/batches/{batch['id']}/retry", json={})
    assert response.status_code == 200, response.text
    retry = response.json()
    assert retry["retry_of"] == batch["id"]
    # its input: exactly the failed lines, in input order, readable from every replica
    for client in failing:
        retried = [line["custom_id"] for line in _lines(client, retry["input_file_id"])]
        assert retried == [custom_id for custom_id in ids if custom_id in failed]
    retry_ended = _ended(a, retry["id"])
    assert retry_ended["request_counts"]["total"] == len(failed)
    assert a.get(f"/v1/batches/{batch['id']}").json()["retries"] == [retry["id"]]

    second = _lines(b, retry_ended["output_file_id"]) + _lines(b, retry_ended["error_file_id"])
    best = {line["custom_id"]: line for line in first}
    for line in second:  # a success beats a failure; between equals, the later attempt
        if _succeeded(line) or not _succeeded(best[line["custom_id"]]):
            best[line["custom_id"]] = line
    views = [client.get(f"/v1/batches/{batch['id']}/merged_results") for client in failing]
    assert all(view.status_code == 200 for view in views), [view.text for view in views]
    assert views[0].content == views[1].content == views[2].content
    merged = [json.loads(line) for line in views[0].content.splitlines()]
    assert [line["custom_id"] for line in merged] == ids  # every request once, in input order
    assert merged == [best[custom_id] for custom_id in ids]
    head = b.head(f"/v1/batches/{batch['id']}/merged_results")
    assert int(head.headers["content-length"]) == len(views[0].content)


def test_two_replicas_asked_at_once_make_one_retry(slow_failing: list[httpx.Client]) -> None:
    a, b, c = slow_failing
    _ids, batch = _run(a, 300, prefix="s")
    assert _ended(c, batch["id"])["status"] == "completed"

    def ask_all(body: dict[str, Any], headers: dict[str, str]) -> list[httpx.Response]:
        answers: list[httpx.Response] = []
        barrier = threading.Barrier(len(slow_failing))

        def ask(client: httpx.Client) -> None:
            barrier.wait()
            answers.append(client.post(f"/v1/batches/{batch['id']}/retry", json=body, headers=headers))

        threads = [threading.Thread(target=ask, args=(client,)) for client in slow_failing]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return answers

    # one key sent to every replica at once: one retry batch, the same one from each
    same_key = ask_all({}, {"Idempotency-Key": "retry-once"})
    assert {answer.status_code for answer in same_key} == {200}, [answer.text for answer in same_key]
    assert len({answer.json()["id"] for answer in same_key}) == 1
    made = same_key[0].json()["id"]
    _ended(a, made)
    # no key, every replica at once: the lines still failing are retried once, and the other
    # calls find that retry running (409 batch_not_final), never a second batch over the lines
    answers = ask_all({"outcomes": ["failed"]}, {})
    made_now = [answer.json()["id"] for answer in answers if answer.status_code == 200]
    assert len(made_now) == 1, [answer.text for answer in answers]
    refused = [answer for answer in answers if answer.status_code != 200]
    assert {(answer.status_code, answer.json()["error"]["code"]) for answer in refused} == {
        (409, "batch_not_final")
    }
    assert b.get(f"/v1/batches/{batch['id']}").json()["retries"] == [made, made_now[0]]


def test_a_batch_is_created_on_a_replica_without_a_copy_of_its_input(
    postgres_url: str, tmp_path: Path, blobs: Blobs
) -> None:
    with running_replicas(tmp_path, postgres_url, blobs, ("a", "b")) as servers:
        a, b = (httpx.Client(base_url=server.base_url, timeout=60) for server in servers)
        lines = jsonl(*(chat_line(f"r{i}", f"q {i}") for i in range(50)))
        uploaded = a.post("/v1/files", files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"}).json()
        for copy in (servers[0].storage_path / "files").glob("*.jsonl"):  # what a's disk held
            copy.unlink()
        created = b.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert created.status_code == 200, created.text
        ended = _ended(a, created.json()["id"])
        assert ended["request_counts"] == {"total": 50, "completed": 50, "failed": 0}
        assert a.get(f"/v1/files/{uploaded['id']}/content").content == lines
