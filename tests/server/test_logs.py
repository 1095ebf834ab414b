"""The server's log: quiet by default (batch lifecycle and errors, nothing per poll), JSON on request.

Live servers, since logging is set up by the ``batchgen-server`` command itself.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from batchgen.server.log_format import JsonFormatter
from batchgen.server.log_limits import RepeatFilter
from tests.helpers import chat_line, create_batch, jsonl, upload, wait_for_status
from tests.live import LiveServer

ServerFactory = Callable[..., LiveServer]


def _log_lines(server: LiveServer) -> list[str]:
    return server.log_path.read_text().splitlines()


def _poll(client: httpx.Client, batch_id: str, times: int) -> None:
    for _ in range(times):
        assert client.get(f"/v1/batches/{batch_id}").status_code == 200


def test_default_log_has_lifecycle_lines_and_nothing_per_poll(server_factory: ServerFactory) -> None:
    server = server_factory("--log-level", "info", "--simulated-latency-s", "0.2", "--max-pool-size", "1")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        done = create_batch(client, upload(client, jsonl(chat_line("a"), chat_line("b")))["id"])
        wait_for_status(client, done["id"], {"completed"})
        cancelled = create_batch(
            client, upload(client, jsonl(*[chat_line(f"r{i}") for i in range(50)]))["id"]
        )
        wait_for_status(client, cancelled["id"], {"in_progress"})
        client.post(f"/v1/batches/{cancelled['id']}/cancel").raise_for_status()
        wait_for_status(client, cancelled["id"], {"cancelled"})

        quiet_from = len(_log_lines(server))
        _poll(client, done["id"], 200)
        for _ in range(20):
            client.get("/health")
            client.get("/v1/pool/status")
            client.get("/metrics")
        assert _log_lines(server)[quiet_from:] == [], "polling wrote log lines at the default level"

    log = "\n".join(_log_lines(server))
    assert f"batch {done['id']} created: 2 requests" in log
    assert f"batch {done['id']} started" in log
    assert f"batch {done['id']} completed: 2 completed, 0 failed of 2 in " in log
    assert f"batch {cancelled['id']} cancelled: " in log
    assert "GET /v1/batches" not in log, "the access log is off by default"


def test_json_log_lines_parse_and_carry_the_batch_fields(server_factory: ServerFactory) -> None:
    server = server_factory(
        "--log-level", "info", "--log-format", "json", "--access-log", "--simulated-latency-s", "0.3",
        "--max-pool-size", "1",
    )  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        done = create_batch(client, upload(client, jsonl(chat_line("a"), chat_line("b")))["id"])
        wait_for_status(client, done["id"], {"completed"})
        late_file = upload(client, jsonl(*[chat_line(f"r{i}") for i in range(30)]))["id"]
        late = create_batch(client, late_file, completion_window="1s")
        wait_for_status(client, late["id"], {"failed"}, timeout_s=30)
        before = len(_log_lines(server))
        _poll(client, done["id"], 5)

    entries: list[dict[str, Any]] = [json.loads(line) for line in _log_lines(server)]  # every line is JSON
    for entry in entries:
        assert {"timestamp", "level", "logger", "event", "message"} <= set(entry)
    by_event = {(entry["event"], entry.get("batch_id")): entry for entry in entries}
    completed = by_event[("batch.completed", done["id"])]
    assert (completed["total"], completed["completed"], completed["failed"]) == (2, 2, 0)
    assert completed["level"] == "info" and isinstance(completed["duration_s"], int)
    assert ("batch.created", done["id"]) in by_event and ("batch.started", done["id"]) in by_event
    failed = by_event[("batch.failed", late["id"])]
    assert failed["level"] == "warning" and "timed out" in failed["reason"]

    polls = [json.loads(line) for line in _log_lines(server)[before:]]
    assert len(polls) == 5 and {entry["event"] for entry in polls} == {"http.request"}
    assert {(entry["method"], entry["path"], entry["status"]) for entry in polls} == {
        ("GET", f"/v1/batches/{done['id']}", 200)
    }


def test_lifecycle_and_access_lines_are_never_rate_limited() -> None:
    repeat_filter = RepeatFilter(limit=2, interval_s=60, clock=lambda: 0.0)

    def record(name: str, message: str, **fields: object) -> logging.LogRecord:
        made = logging.LogRecord(name, logging.INFO, "/x.py", 7, message, None, None)
        made.__dict__.update(fields)
        return made

    lifecycle = [record("batchgen.batches", "batch %s %s: %s", event="batch.completed") for _ in range(20)]
    access = [record("uvicorn.access", '%s - "%s %s HTTP/%s" %d') for _ in range(20)]
    other = [record("batchgen.service", "retrying %s") for _ in range(20)]
    assert all(repeat_filter.filter(each) for each in lifecycle + access)
    assert sum(repeat_filter.filter(each) for each in other) == 2


def test_json_formatter_writes_fields_and_tracebacks_on_one_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        made = logging.LogRecord(
            "batchgen", logging.ERROR, "/x.py", 7, "failed %s", ("here",), sys.exc_info()
        )
    made.__dict__.update(event="batch.failed", batch_id="batch_1", count=3, path=Path("/p"))
    [line] = JsonFormatter().format(made).splitlines()
    entry = json.loads(line)
    assert (
        entry["message"] == "failed here" and entry["level"] == "error" and entry["event"] == "batch.failed"
    )
    assert (entry["batch_id"], entry["count"], entry["path"]) == ("batch_1", 3, "/p")
    assert "RuntimeError: boom" in entry["exception"]
