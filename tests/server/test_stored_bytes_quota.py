"""A tenant's limits hold however its bytes and batches arrive, on a real ``batchgen-server``.

Plain uploads sent all at once to a tenant whose ``max_stored_bytes`` fits only some of them:
exactly as many as fit are stored, the others get 413 ``quota_exceeded``. A retry's new input file
counts against the batch owner's ``max_stored_bytes``, and an admin's retry of a tenant's batch
meets that tenant's ``max_active_batches``, both refused naming the tenant's limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import api_error, chat_line, create_batch, jsonl, post_file, upload, wait_for_status
from tests.keys import authorized, create_key, keys_command
from tests.live import LiveServer

pytestmark = pytest.mark.live  # live servers, and the keys command

#: Slow requests on one slot: a batch stays active until it is cancelled.
SLOW = ("--simulated-latency-s", "5", "--max-pool-size", "1")


def _stored(client: httpx.Client) -> list[dict[str, Any]]:
    files: list[dict[str, Any]] = client.get("/v1/files").json()["data"]
    return [file for file in files if file["purpose"] != "batch_output"]


def _ended_batch(client: httpx.Client, content: bytes) -> dict[str, Any]:
    """A batch over ``content`` cancelled before its requests ran: every line can be retried."""
    batch = create_batch(client, upload(client, content)["id"])
    client.post(f"/v1/batches/{batch['id']}/cancel").raise_for_status()
    return wait_for_status(client, batch["id"], {"cancelled"})


def test_parallel_uploads_store_exactly_as_many_as_fit(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    content = jsonl(*[chat_line(f"line-{i}", "x" * 200) for i in range(600)])  # validated for a while
    size, sent, fit = len(content), 10, 3
    storage = tmp_path / "storage"
    _, key = create_key(storage, "alice", "--max-stored-bytes", str(fit * size + size // 2))
    server = server_factory(storage="storage")
    start = threading.Barrier(sent)

    def send(_: int) -> httpx.Response:
        with authorized(server.base_url, key) as client:
            start.wait(timeout=60)
            return post_file(client, content)

    with ThreadPoolExecutor(sent) as pool:
        responses = list(pool.map(send, range(sent)))
    assert sorted(response.status_code for response in responses) == [200] * fit + [413] * (sent - fit)
    for response in responses:
        if response.status_code == 413:
            error = api_error(response, 413)
            assert error["code"] == "quota_exceeded" and "max_stored_bytes" in error["message"]
    with authorized(server.base_url, key) as alice:
        stored = _stored(alice)
        assert sorted(file["id"] for file in stored) == sorted(
            response.json()["id"] for response in responses if response.status_code == 200
        )
        assert sum(file["bytes"] for file in stored) == fit * size


def test_a_retry_stores_its_input_only_within_the_owners_bytes(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """The retry's new input file is the owner's: refused when it would pass the owner's
    ``max_stored_bytes``, whether the owner or an admin asks; nothing of it is left behind."""
    content = jsonl(*[chat_line(f"q-{i}") for i in range(4)])
    storage = tmp_path / "storage"
    _, key = create_key(storage, "carol", "--max-stored-bytes", str(len(content) * 3 // 2))
    _, admin_key = create_key(storage, "ops", "--admin")
    server = server_factory(*SLOW, storage="storage")
    with authorized(server.base_url, key) as carol, authorized(server.base_url, admin_key) as admin:
        original = _ended_batch(carol, content)
        for client in (carol, admin):
            error = api_error(client.post(f"/v1/batches/{original['id']}/retry", json={}), 413)
            assert error["code"] == "quota_exceeded"
            assert "'carol'" in error["message"] and "max_stored_bytes" in error["message"]
        assert [file["id"] for file in _stored(carol)] == [original["input_file_id"]]
        keys_command(storage, "set-limits", "--tenant", "carol", "--max-stored-bytes", str(len(content) * 2))
        retry = admin.post(f"/v1/batches/{original['id']}/retry", json={})
        assert retry.status_code == 200, retry.text
        assert sum(file["bytes"] for file in _stored(carol)) == 2 * len(content)
        carol.post(f"/v1/batches/{retry.json()['id']}/cancel").raise_for_status()


def test_an_admins_retry_meets_the_owners_active_batch_limit(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    storage = tmp_path / "storage"
    _, key = create_key(storage, "dora", "--max-active-batches", "1")
    _, admin_key = create_key(storage, "ops", "--admin")
    server = server_factory(*SLOW, storage="storage")
    with authorized(server.base_url, key) as dora, authorized(server.base_url, admin_key) as admin:
        original = _ended_batch(dora, jsonl(*[chat_line(f"a-{i}") for i in range(3)]))
        running = create_batch(dora, upload(dora, jsonl(*[chat_line(f"b-{i}") for i in range(3)]))["id"])
        refused = admin.post(f"/v1/batches/{original['id']}/retry", json={})
        error = api_error(refused, 429)
        assert "Tenant 'dora'" in error["message"] and "max_active_batches" in error["message"]
        assert "retry-after" in refused.headers
        assert len(_stored(dora)) == 2  # no retry input left behind
        dora.post(f"/v1/batches/{running['id']}/cancel").raise_for_status()
        wait_for_status(dora, running["id"], {"cancelled"})
        retry = admin.post(f"/v1/batches/{original['id']}/retry", json={})
        assert retry.status_code == 200, retry.text
        assert dora.get(f"/v1/batches/{retry.json()['id']}").status_code == 200  # dora's batch
        dora.post(f"/v1/batches/{retry.json()['id']}/cancel").raise_for_status()
