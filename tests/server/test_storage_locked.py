"""A metadata database locked by another process: every route answers, none hangs, none is a 500.

A second, real SQLite connection in the test process holds ``BEGIN EXCLUSIVE`` on the server's
``metadata.sqlite3`` (what a backup tool, a ``sqlite3`` shell or a stuck process does). While it
holds the lock, every route the app registers (read from the app, so a new route is covered the
day it is added) answers within a small client timeout, with or without API keys: a call that
needs to write answers 503 ``storage_unavailable`` with ``Retry-After``, one that only reads
answers as usual; ``/health`` keeps answering throughout, so the event loop is never held by a
storage wait. A key used for the first time while the lock is held works (its last-use time is
saved later, off the request path). Once the lock is released everything works again.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from litestar.routes import HTTPRoute

from batchgen.server.api_keys import KeyStore
from tests.conftest import in_process_app
from tests.database_lock import locked_elsewhere
from tests.helpers import chat_line, create_batch, jsonl, post_batch, post_file, upload, wait_for_status
from tests.live import LiveServer

#: Long enough for a batch to stay in progress (so it can be cancelled) for the whole test.
FLAGS = ("--simulated-latency-s", "30", "--max-pool-size", "1")
#: A request that has not answered by then hangs (the old code waited 5 to 30 s on the loop).
CLIENT_TIMEOUT_S = 10.0
#: Routes that cannot be served without writing the database.
WRITES = {("POST", "/v1/files"), ("POST", "/v1/batches"), ("DELETE", "/v1/files/{file_id}")}


def _routes(tmp_path: Path) -> list[tuple[str, str]]:
    """(method, path template) of every route the app registers, HEAD and OPTIONS aside."""
    app = in_process_app(tmp_path / "routes-only")
    found = {
        (method, re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path))  # {model_id:path} -> {model_id}
        for route in app.routes
        if isinstance(route, HTTPRoute)
        for method in route.methods
        if method not in ("HEAD", "OPTIONS")
    }
    assert ("POST", "/v1/files") in found and ("GET", "/health") in found
    return sorted(found)


def _call(client: httpx.Client, method: str, template: str, ids: dict[str, str]) -> httpx.Response:
    path = template.format_map(
        {
            "file_id": ids["file_id"],
            "batch_id": ids["batch_id"],
            "upload_id": ids["upload_id"],
            "name": "x",
            "path": "x",
            "model_id": "simulated",
        }
    )
    if (method, template) == ("POST", "/v1/files"):
        return post_file(client, jsonl(chat_line("locked")))
    if (method, template) == ("POST", "/v1/batches"):
        return post_batch(client, ids["input_file_id"])
    return client.request(method, path)


def _check_locked_answer(method: str, template: str, response: httpx.Response) -> None:
    where = f"{method} {template} -> {response.status_code} {response.text[:300]}"
    if (method, template) in WRITES or response.status_code >= 500:
        assert response.status_code == 503, where
        assert response.json()["error"]["code"] == "storage_unavailable", where
        assert int(response.headers["retry-after"]) >= 1, where


@pytest.mark.parametrize("with_keys", [False, True], ids=["no keys", "keys"])
def test_every_route_answers_while_another_process_holds_the_database_locked(
    server_factory: Callable[..., LiveServer], tmp_path: Path, with_keys: bool
) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    headers: dict[str, str] = {}
    locked_headers: dict[str, str] = {}
    fresh_key_id = ""
    if with_keys:
        command = KeyStore(storage / "metadata.sqlite3")
        _, key = command.create_key("alpha", admin=True)
        fresh_key_id, fresh_key = command.create_key("alpha", admin=True)  # first used under the lock
        command.close()
        headers = {"Authorization": f"Bearer {key}"}
        locked_headers = {"Authorization": f"Bearer {fresh_key}"}
    routes = _routes(tmp_path)
    server = server_factory(*FLAGS)
    assert server.storage_path == storage
    with httpx.Client(base_url=server.base_url, timeout=30, headers=headers) as client:
        input_file_id = upload(client, jsonl(chat_line("a"), chat_line("b")))["id"]
        running = create_batch(client, input_file_id)
        wait_for_status(client, running["id"], {"in_progress"})
        ids = {
            "file_id": upload(client, jsonl(chat_line("spare")))["id"],
            "batch_id": running["id"],
            "input_file_id": upload(client, jsonl(chat_line("unused")))["id"],
            "upload_id": client.post(
                "/v1/uploads",
                json={"bytes": 10, "filename": "a.jsonl", "mime_type": "text/jsonl", "purpose": "batch"},
            ).json()["id"],
        }

    answers: dict[tuple[str, str], httpx.Response] = {}
    health: list[int] = []
    with (
        locked_elsewhere(storage / "metadata.sqlite3"),
        httpx.Client(base_url=server.base_url, timeout=CLIENT_TIMEOUT_S, headers=locked_headers) as locked,
    ):
        done = threading.Event()

        def poll_health() -> None:
            with httpx.Client(base_url=server.base_url, timeout=CLIENT_TIMEOUT_S) as probe:
                while not done.is_set() or not health:
                    health.append(probe.get("/health").status_code)

        def call(route: tuple[str, str]) -> tuple[tuple[str, str], httpx.Response]:
            return route, _call(locked, *route, ids)

        with ThreadPoolExecutor(max_workers=4) as pool:
            poller = pool.submit(poll_health)
            try:
                answers = dict(pool.map(call, [route for route in routes if route[1] != "/health"]))
            finally:
                done.set()
            poller.result()

    assert health and set(health) == {200}, f"/health under the lock answered {health}"
    for (method, template), response in answers.items():
        _check_locked_answer(method, template, response)
    assert {route for route in WRITES if route in answers} == WRITES

    with httpx.Client(base_url=server.base_url, timeout=30, headers=locked_headers or headers) as client:
        again = upload(client, jsonl(chat_line("after")))
        batch = create_batch(client, again["id"])
        assert client.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
        # cancelled under the lock (saved once the lock went) or now
        assert client.post(f"/v1/batches/{running['id']}/cancel").status_code in (200, 409)
        wait_for_status(client, running["id"], {"cancelled"})
        assert client.delete(f"/v1/files/{ids['file_id']}").status_code == 200
        assert client.get(f"/v1/files/{ids['file_id']}").status_code == 404
    if with_keys:
        _wait_for_last_use(storage / "metadata.sqlite3", fresh_key_id)


def _wait_for_last_use(database: Path, key_id: str) -> None:
    """The key first used under the lock has its last-use time saved once the lock is gone."""
    store = KeyStore(database)
    try:
        deadline = time.monotonic() + 30
        while True:
            [record] = [key for key in store.list_keys() if key.id == key_id]
            if record.last_used_at is not None:
                return
            assert time.monotonic() < deadline, "the last use of a key was never saved"
            time.sleep(0.1)
    finally:
        store.close()
