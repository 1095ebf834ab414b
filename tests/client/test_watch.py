"""`batchgen watch`: progress of several batches until they all end. The drawing and polling on
the mock API (httpx.MockTransport), then the command itself against live servers."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchgen.client import BatchGenHttpClient, RetryPolicy
from batchgen.client._watch import BatchBoard, active_batch_ids, watch_batches
from batchgen.client.cli import EXIT_BATCH_FAILED, EXIT_OK, EXIT_SERVER_ERROR
from tests.client.scripted_api import error_body
from tests.helpers import chat_line, read_terminal, submit
from tests.live import LiveServer

BASE = "http://batchgen.test"


def state(
    batch_id: str, status: str, done: int, total: int = 10, failed: int = 0, **extra: Any
) -> dict[str, Any]:
    counts = {"total": total, "completed": done - failed, "failed": failed}
    return {"id": batch_id, "object": "batch", "status": status, "request_counts": counts,
            "created_at": 1000, **extra}  # fmt: skip


class Progressing:
    """Batches that move one step along their script on each GET (the last step repeats), and a
    listing of `listed` in pages of `page_size`."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]], listed: list[dict[str, Any]] | None = None,
                 page_size: int = 2) -> None:  # fmt: skip
        self.scripts = scripts
        self.polls = dict.fromkeys(scripts, 0)
        self.listed = listed or []
        self.page_size = page_size
        self.list_calls: list[dict[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        if parts == ["v1", "batches"]:
            params = dict(request.url.params)
            self.list_calls.append(params)
            ids = [batch["id"] for batch in self.listed]
            start = ids.index(params["after"]) + 1 if "after" in params else 0
            page = self.listed[start : start + self.page_size]
            more = start + self.page_size < len(self.listed)
            return httpx.Response(200, json={"object": "list", "data": page, "has_more": more})
        batch_id = parts[-1]
        if batch_id not in self.scripts:
            return httpx.Response(404, json=error_body(f"No batch with id '{batch_id}'.", "not_found"))
        script = self.scripts[batch_id]
        step = min(self.polls[batch_id], len(script) - 1)
        self.polls[batch_id] += 1
        return httpx.Response(200, json=script[step])


@pytest.fixture
def make_client() -> Iterator[Any]:
    made: list[BatchGenHttpClient] = []

    def make(handler: Progressing) -> BatchGenHttpClient:
        client = BatchGenHttpClient(
            BASE, transport=httpx.MockTransport(handler), retry=RetryPolicy(max_retries=0)
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_watch_polls_until_every_batch_has_ended_and_prints_each_change_once(make_client: Any) -> None:
    api = Progressing({
        "batch_a": [state("batch_a", "in_progress", 2), state("batch_a", "in_progress", 2),
                    state("batch_a", "in_progress", 6), state("batch_a", "completed", 10, completed_at=1012)],
        "batch_b": [state("batch_b", "validating", 0), state("batch_b", "in_progress", 3, failed=1),
                    state("batch_b", "failed", 3, failed=1, failed_at=1005)],
    })  # fmt: skip
    ticks, out = Ticks(), io.StringIO()
    board = BatchBoard(out, redraw=False, clock=ticks.clock)
    final = watch_batches(make_client(api), ["batch_a", "batch_b", "batch_a"], board, poll_interval=0.5,
                          sleep=ticks.sleep)  # fmt: skip
    assert [batch["status"] for batch in final] == ["completed", "failed"]  # duplicates watched once
    assert ticks.sleeps == [0.5, 0.5, 0.5]  # four rounds of polls, a wait between each
    lines = out.getvalue().splitlines()
    a_lines = [line for line in lines if line.startswith("batch_a")]
    b_lines = [line for line in lines if line.startswith("batch_b")]
    assert len(a_lines) == 3  # 2 done, 6 done, completed: the repeat of "2 done" is not printed
    assert len(b_lines) == 3  # validating, in_progress, failed; nothing after it ended
    assert "10/10 done" in a_lines[-1] and "in 12s" in a_lines[-1]
    assert "1 failed" in b_lines[-1] and b_lines[-1].split()[1] == "failed"
    assert "\x1b[" not in out.getvalue()  # no terminal control on a plain stream


def test_the_rate_and_eta_come_from_the_server_when_it_sends_them(make_client: Any) -> None:
    api = Progressing({
        "batch_a": [state("batch_a", "in_progress", 40, total=100, requests_per_second=20.0),
                    state("batch_a", "completed", 100, total=100)],
    })  # fmt: skip
    ticks, out = Ticks(), io.StringIO()
    watch_batches(make_client(api), ["batch_a"], BatchBoard(out, redraw=False, clock=ticks.clock),
                  sleep=ticks.sleep)  # fmt: skip
    first = out.getvalue().splitlines()[0]
    assert "ETA 3s" in first and "20 req/s" in first  # 60 left at 20/s


def test_without_a_server_rate_it_is_measured_between_polls(make_client: Any) -> None:
    api = Progressing({
        "batch_a": [state("batch_a", "in_progress", i * 10, total=100, requests_per_second=None)
                    for i in range(1, 5)] + [state("batch_a", "completed", 100, total=100)],
    })  # fmt: skip
    ticks, out = Ticks(), io.StringIO()
    watch_batches(make_client(api), ["batch_a"], BatchBoard(out, redraw=False, clock=ticks.clock),
                  poll_interval=2.0, sleep=ticks.sleep)  # fmt: skip
    lines = out.getvalue().splitlines()
    assert "req/s" not in lines[0]  # one poll: no rate yet
    assert "5.0 req/s" in lines[1] and "ETA 16s" in lines[1]  # 10 more in 2 s; 80 left


def test_on_a_terminal_the_block_of_lines_is_redrawn_in_place(
    make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LINES", "24")
    monkeypatch.setenv("COLUMNS", "120")
    api = Progressing({
        "batch_a": [state("batch_a", "in_progress", 5), state("batch_a", "completed", 10)],
        "batch_b": [state("batch_b", "in_progress", 1), state("batch_b", "completed", 10)],
    })  # fmt: skip
    ticks, out = Ticks(), io.StringIO()
    watch_batches(make_client(api), ["batch_a", "batch_b"], BatchBoard(out, redraw=True, clock=ticks.clock),
                  sleep=ticks.sleep)  # fmt: skip
    first, second = out.getvalue().split("\x1b[2A")  # up two lines, once: before the second round
    assert first.count("\n") == second.count("\n") == 2
    assert "completed" in second and "in_progress" not in second


def test_more_batches_than_terminal_rows_are_printed_as_they_change(
    make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LINES", "3")  # shutil.get_terminal_size reads these first
    monkeypatch.setenv("COLUMNS", "120")
    ids = [f"batch_{i}" for i in range(3)]
    api = Progressing({i: [state(i, "in_progress", 1), state(i, "completed", 10)] for i in ids})
    ticks, out = Ticks(), io.StringIO()
    watch_batches(make_client(api), ids, BatchBoard(out, redraw=True, clock=ticks.clock), sleep=ticks.sleep)
    assert "\x1b[" not in out.getvalue()
    assert len(out.getvalue().splitlines()) == 6  # each batch: in progress, then completed


def test_active_batch_ids_reads_every_page_and_leaves_out_ended_batches(make_client: Any) -> None:
    listed = [
        state("batch_5", "in_progress", 1),
        state("batch_4", "completed", 10),
        state("batch_3", "validating", 0),
        state("batch_2", "cancelling", 3),
        state("batch_1", "failed", 0),
    ]
    api = Progressing({}, listed=listed, page_size=2)
    assert active_batch_ids(make_client(api)) == ["batch_5", "batch_3", "batch_2"]
    assert [call.get("after") for call in api.list_calls] == [None, "batch_4", "batch_2"]


# --- the command, against live servers -------------------------------------------------------------

FLAGS = ("--simulated-latency-s", "0.1", "--max-pool-size", "4")


def watch(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchgen.client.cli", "watch", "--poll-interval", "0.2", *args,
         "--base-url", server.base_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.live
def test_watch_with_no_ids_follows_every_active_batch_to_its_end(server_factory: Any) -> None:
    server = server_factory(*FLAGS)
    with httpx.Client(base_url=server.base_url) as api:
        first = submit(api, [chat_line(f"a{i}") for i in range(40)])
        second = submit(api, [chat_line(f"b{i}") for i in range(20)])
        result = watch(server)
        assert result.returncode == EXIT_OK, result.stderr
        for batch in (first, second):
            lines = [line for line in result.stderr.splitlines() if line.startswith(batch["id"][:16])]
            assert lines and "completed" in lines[-1], result.stderr
            assert api.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed"
    assert "req/s" in result.stderr
    assert result.stdout == ""


@pytest.mark.live
def test_watch_exits_1_when_a_batch_is_cancelled_and_3_for_an_unknown_one(server_factory: Any) -> None:
    server = server_factory("--simulated-latency-s", "0.5", "--max-pool-size", "1")
    with httpx.Client(base_url=server.base_url) as api:
        batch = submit(api, [chat_line(f"c{i}") for i in range(50)])
        process = subprocess.Popen(
            [sys.executable, "-m", "batchgen.client.cli", "watch", batch["id"], "--poll-interval", "0.2",
             "--base-url", server.base_url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert api.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
        _, err = process.communicate(timeout=120)
    assert process.returncode == EXIT_BATCH_FAILED, err
    assert f"batch {batch['id']} ended cancelled" in err
    missing = watch(server, "batch_nope")
    assert missing.returncode == EXIT_SERVER_ERROR
    assert "No batch with id 'batch_nope'" in missing.stderr


@pytest.mark.live
def test_watch_draws_bars_in_place_on_a_terminal(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory(*FLAGS)
    with httpx.Client(base_url=server.base_url) as api:
        batch = submit(api, [chat_line(f"t{i}") for i in range(30)])
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "batchgen.client.cli", "watch", batch["id"], "--poll-interval", "0.1",
         "--base-url", server.base_url],
        stdout=subprocess.PIPE, stderr=terminal,
    )  # fmt: skip
    os.close(terminal)
    shown = read_terminal(controller)
    assert process.wait(timeout=60) == EXIT_OK
    text = shown.decode()
    assert "\x1b[1A" in text  # the line was redrawn
    assert "completed" in text.rsplit("\x1b[1A", 1)[-1] and "30/30 done" in text
