"""Polling is cheap: ``GET /v1/batches/{id}`` and ``GET /v1/pool/status`` of a running batch touch no
database, and answer ``304 Not Modified`` to a client that already has the current answer.

The app is the real one (``create_app``) over a real SQLite file whose connection records every
SQL statement it runs (``sqlite3``'s trace callback); the background jobs that write counters are
set to run rarely, so that during the polls the only possible SQL is what the polls would cause.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.service import BatchService, ServiceSettings
from batchgen.core.storage import SQLiteMetadataStore
from batchgen.server.app import create_app
from batchgen.server.etags import matches
from batchgen.server.settings import ServerSettings
from tests.helpers import chat_line, submit, wait_for_status
from tests.live import LiveServer


class TracedMetadata(SQLiteMetadataStore):
    """The SQLite metadata store, recording each SQL statement its connection runs."""

    statements: list[str]

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.statements = []
        connection: sqlite3.Connection = self._db.conn
        connection.set_trace_callback(self.statements.append)


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[TestClient[Litestar], list[TracedMetadata]]]:
    stores: list[TracedMetadata] = []

    def open_metadata(path: Path) -> TracedMetadata:
        stores.append(TracedMetadata(path))
        return stores[-1]

    settings = ServiceSettings(
        storage_path=tmp_path / "storage",
        max_pool_size=1,
        counters_flush_interval_s=3600,
        maintenance_interval_s=3600,
        fsync_interval_ms=3_600_000,
    )
    service = BatchService(settings, SimulatedBackend(latency_s=0.5), open_metadata=open_metadata)
    app = create_app(ServerSettings(storage_path=tmp_path / "storage", api_nice=0), service=service)
    with TestClient(app, timeout=30) as client:
        yield client, stores


def test_polling_a_running_batch_and_the_pools_runs_no_sql(
    traced: tuple[TestClient[Litestar], list[TracedMetadata]],
) -> None:
    client, [store] = traced
    batch = submit(client, [chat_line(f"r{i}") for i in range(20)])
    batch = wait_for_status(client, batch["id"], {"in_progress"})
    time.sleep(0.1)  # let the status change that was just saved settle
    store.statements.clear()
    answers = [client.get(f"/v1/batches/{batch['id']}") for _ in range(50)]
    pools = [client.get("/v1/pool/status") for _ in range(50)]
    assert store.statements == []
    assert {answer.status_code for answer in answers + pools} == {200}
    assert all(answer.json()["status"] == "in_progress" for answer in answers)
    assert pools[-1].json()["active_batches"] == 1
    # A finished batch is read from the database, as before.
    client.post(f"/v1/batches/{batch['id']}/cancel")
    wait_for_status(client, batch["id"], {"cancelled"})
    store.statements.clear()
    assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "cancelled"
    assert any("batches" in statement for statement in store.statements)


def test_if_none_match_gets_304_until_the_batch_changes(
    traced: tuple[TestClient[Litestar], list[TracedMetadata]],
) -> None:
    client, _ = traced
    batch = submit(client, [chat_line(f"r{i}") for i in range(3)])
    url = f"/v1/batches/{batch['id']}"
    first = client.get(url)
    tag = first.headers["etag"]
    assert first.status_code == 200 and tag.startswith('"') and first.headers["cache-control"] == "no-cache"
    # While nothing changed, the same tag (also weak, or in a list) gets an empty 304.
    seen = first.content
    for form in ("{}", "W/{}", '"other", {}', "*"):
        again = client.get(url, headers={"If-None-Match": form.format(tag)})
        if again.status_code == 200:  # the batch moved on between the two calls
            assert again.content != seen and again.headers["etag"] != tag
            seen, tag = again.content, again.headers["etag"]
            continue
        assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == tag
    # A tag that is not the current one gets the body.
    stale = client.get(url, headers={"If-None-Match": '"not-the-tag"'})
    assert stale.status_code == 200 and stale.json()["id"] == batch["id"]
    # Once the batch has moved on, the old tag no longer matches and the new answer comes back.
    done = wait_for_status(client, batch["id"], {"completed"})
    changed = client.get(url, headers={"If-None-Match": first.headers["etag"]})
    assert changed.status_code == 200 and changed.json() == done
    assert changed.headers["etag"] != first.headers["etag"]
    pools = client.get("/v1/pool/status")
    assert client.get("/v1/pool/status", headers={"If-None-Match": pools.headers["etag"]}).status_code == 304


@pytest.mark.parametrize(
    ("header", "tag", "expected"),
    [
        (None, '"a"', False),
        ("", '"a"', False),
        ('"a"', '"a"', True),
        ('W/"a"', '"a"', True),
        ('"b", "a"', '"a"', True),
        ('"b"', '"a"', False),
        ("*", '"a"', True),
        ('"a', '"a"', False),
    ],
)
def test_if_none_match_comparison(header: str | None, tag: str, expected: bool) -> None:
    assert matches(header, tag) is expected


@pytest.mark.live
def test_the_openai_sdk_and_raw_httpx_poll_a_live_server(live_server: LiveServer) -> None:
    with httpx.Client(base_url=live_server.base_url, timeout=30) as raw:
        batch = submit(raw, [chat_line(f"r{i}") for i in range(5)])
        sdk = openai.OpenAI(base_url=live_server.api_url, api_key="unused", max_retries=0)
        polled = sdk.batches.retrieve(batch["id"])
        assert polled.id == batch["id"] and polled.request_counts is not None
        done = wait_for_status(raw, batch["id"], {"completed"})
        answer = raw.get(f"/v1/batches/{batch['id']}")
        assert answer.status_code == 200 and answer.json() == done
        unchanged = raw.get(f"/v1/batches/{batch['id']}", headers={"If-None-Match": answer.headers["etag"]})
        assert unchanged.status_code == 304 and unchanged.content == b""
        assert sdk.batches.retrieve(batch["id"]).status == "completed"
