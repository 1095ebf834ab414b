"""Backpressure: a full intake pool answers 429 with Retry-After, and pool status tracks the work.

The real app runs in this process (Litestar's test client) over real SQLite and files; the
Retry-After of a pool that drains in seconds is checked against a real ``batchgen-server``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from tests.helpers import ApiFactory, chat_line, jsonl, post_batch, upload, wait_for_status
from tests.live import LiveServer


def _create(client: httpx.Client, name: str, count: int) -> httpx.Response:
    file_id = upload(client, jsonl(*[chat_line(f"{name}-{i}") for i in range(count)]))["id"]
    return post_batch(client, file_id)


def test_full_intake_pool_gives_429_then_accepts_after_draining(api_factory: ApiFactory) -> None:
    client = api_factory(
        "--max-intake-capacity", "10", "--max-pool-size", "2", "--simulated-latency-s", "0.3"
    )
    idle = client.get("/v1/pool/status").json()
    assert idle == {
        "intake_pool_size": 0,
        "intake_pool_capacity": 10,
        "scheduling_pool_active": 0,
        "scheduling_pool_free": 2,
        "scheduling_pool_capacity": 2,
        "active_batches": 0,
        "pool_mode": True,
        "requests_completed_total": 0,
        "requests_failed_total": 0,
        "prompt_tokens_total": 0,
        "completion_tokens_total": 0,
        "engine_running": 0,
        "engine_waiting": 0,
        "engines": [{"model": "simulated", "running": 0, "generated_tokens": None}],
        "generated_tokens_total": 0,
        "generated_tokens_counted": "when_finished",
        "requests_per_second": 0.0,
        "tokens_per_second": 0.0,
        "rate_time_constant_s": 30.0,
    }
    first = _create(client, "first", 10)
    assert first.status_code == 200
    wait_for_status(client, first.json()["id"], {"in_progress"})
    busy = client.get("/v1/pool/status").json()
    assert busy["scheduling_pool_active"] == 2 and busy["scheduling_pool_free"] == 0
    assert busy["intake_pool_size"] == 8 and busy["active_batches"] == 1

    rejected = _create(client, "second", 5)
    assert rejected.status_code == 429
    assert int(rejected.headers["Retry-After"]) > 0
    error = rejected.json()["error"]
    assert error["code"] == "capacity_exceeded" and "intake" in error["message"]

    done = wait_for_status(client, first.json()["id"], {"completed"})
    assert done["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
    drained = client.get("/v1/pool/status").json()
    assert drained["requests_completed_total"] == 10 and drained["completion_tokens_total"] > 0
    totals = (
        "requests_completed_total",
        "prompt_tokens_total",
        "completion_tokens_total",
        "generated_tokens_total",
    )
    rates = dict.fromkeys(("requests_per_second", "tokens_per_second"), 0.0)
    assert drained | dict.fromkeys(totals, 0) | rates == idle  # the rest as it was before the batch
    retried = _create(client, "third", 5)
    assert retried.status_code == 200
    assert wait_for_status(client, retried.json()["id"], {"completed"})["request_counts"]["completed"] == 5


def test_batch_larger_than_the_intake_pool_fails_with_capacity_exceeded(api_factory: ApiFactory) -> None:
    client = api_factory("--max-intake-capacity", "3")
    created = _create(client, "big", 4)
    assert created.status_code == 200
    failed = wait_for_status(client, created.json()["id"], {"failed"})
    assert failed["error"]["code"] == "capacity_exceeded"
    assert "room for 3" in failed["error"]["message"]
    assert failed["errors"]["data"][0]["code"] == "capacity_exceeded"
    assert failed["failed_at"] is not None
    assert client.get("/health").status_code == 200


def test_second_active_batch_on_the_same_file_is_400(api_factory: ApiFactory) -> None:
    client = api_factory("--simulated-latency-s", "0.5", "--max-pool-size", "1")
    file_id = upload(client, jsonl(*[chat_line(f"r{i}") for i in range(3)]))["id"]
    first = post_batch(client, file_id).json()
    duplicate = post_batch(client, file_id)
    assert duplicate.status_code == 400
    assert first["id"] in duplicate.json()["error"]["message"]
    delete = client.delete(f"/v1/files/{file_id}")
    assert delete.status_code == 409
    client.post(f"/v1/batches/{first['id']}/cancel")
    wait_for_status(client, first["id"], {"cancelled"})
    assert post_batch(client, file_id).status_code == 200


@pytest.mark.live
def test_retry_after_of_a_pool_that_drains_in_seconds_is_seconds(
    server_factory: Callable[..., LiveServer],
) -> None:
    """Two slots of 1.5 s requests and an intake pool of 8 that a batch of 8 holds: room for a
    batch of 3 comes within a few seconds of the work beginning, so the Retry-After told meanwhile
    is at most about that (twice the drain measured from the first create, to leave room for the
    estimate), never a fixed 30."""
    server = server_factory(
        "--max-intake-capacity", "8", "--max-pool-size", "2", "--simulated-latency-s", "1.5"
    )  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        first_file = upload(client, jsonl(*[chat_line(f"first-{i}") for i in range(8)]))["id"]
        second_file = upload(client, jsonl(*[chat_line(f"second-{i}") for i in range(3)]))["id"]
        began = time.monotonic()
        first = post_batch(client, first_file)
        assert first.status_code == 200, first.text
        refused = post_batch(client, second_file)  # 8 places held: at most 2 come free before it
        assert refused.status_code == 429, refused.text
        retry_after = int(refused.headers["Retry-After"])
        deadline = time.monotonic() + 60
        while client.get("/v1/pool/status").json()["intake_pool_size"] > 5:  # room for three
            assert time.monotonic() < deadline, "the intake pool never drained"
            time.sleep(0.05)
        drained_s = time.monotonic() - began
        assert 1 <= retry_after <= 2 * drained_s + 1, (retry_after, drained_s)
        assert post_batch(client, second_file).status_code == 200
