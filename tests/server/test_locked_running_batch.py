"""A batch running while another process holds the metadata database locked: nothing fails, nothing is lost.

A second, real SQLite connection holds ``BEGIN EXCLUSIVE`` on the server's ``metadata.sqlite3``
while a batch runs on the simulated backend, some of its lines failing (prompts longer than the
model's context: error lines). Under both ``--error-file`` conventions the batch keeps running
in memory: its first error line (which, under OpenAI's convention, makes its error file), its
counters, its completion and the webhook message saved with it wait for the lock, and once the
lock is released the batch ends ``completed`` with every line once and the right counts.

While the lock is held the server says what is wrong: ``/health`` names the storage, a create
answers 503 ``storage_unavailable`` with ``Retry-After`` (never ``service_unavailable``, never
a 500), and the maintenance jobs that wait for the database log one warning each, not a
traceback every half second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from tests.conftest import in_process_app
from tests.database_lock import locked_elsewhere
from tests.helpers import chat_line, file_lines, jsonl, post_batch, upload, wait_for_status
from tests.webhook_receiver import WebhookReceiver

#: Requests take long enough that the batch is still running when the lock is taken (with room
#: for a slow machine: the first lines end a second after the batch starts).
FLAGS = ("--simulated-latency-s", "1.0", "--max-pool-size", "2")
#: Words in a prompt longer than the simulated model's context (8,192 tokens): an error line.
TOO_LONG = " ".join(["word"] * 9000)


def _lines(failing: set[int], total: int) -> list[dict[str, Any]]:
    return [
        chat_line(f"r{index}", TOO_LONG if index in failing else f"question {index}")
        for index in range(total)
    ]


def _lines_on_disk(storage: Path, batch_id: str) -> int:
    count = 0
    for path in (storage / "incremental").glob(f"{batch_id}*.jsonl"):
        count += len(path.read_bytes().splitlines())
    return count


def _wait_for_lines(storage: Path, batch_id: str, wanted: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while _lines_on_disk(storage, batch_id) < wanted:
        assert time.monotonic() < deadline, f"only {_lines_on_disk(storage, batch_id)} of {wanted} lines"
        time.sleep(0.05)


def _wait_for_health(client: TestClient[Litestar], status: int, timeout_s: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.get("/health")
        if response.status_code == status:
            body: dict[str, Any] = response.json()
            return body
        assert time.monotonic() < deadline, f"/health stayed {response.status_code}: {response.text}"
        time.sleep(0.1)


@pytest.mark.parametrize("error_file", ["output", "openai"])
@pytest.mark.parametrize(
    "failing",
    [{2, 3, 5}, {2}, {4, 5, 6, 7}],
    ids=["some fail", "one fails", "the last fail"],
)
def test_a_batch_running_under_a_lock_completes_with_every_line_once(
    api_factory: Callable[..., TestClient[Litestar]],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    error_file: str,
    failing: set[int],
) -> None:
    total = 8
    receiver = WebhookReceiver()
    request.addfinalizer(receiver.close)
    client = api_factory(*FLAGS, "--error-file", error_file, "--webhook-url", receiver.url)
    storage = tmp_path / "storage"
    input_file = upload(client, jsonl(*_lines(failing, total)))
    spare = upload(client, jsonl(chat_line("spare")))
    response = post_batch(client, input_file["id"])
    assert response.status_code == 200, response.text
    batch_id = response.json()["id"]
    wait_for_status(client, batch_id, {"in_progress"})
    assert _lines_on_disk(storage, batch_id) == 0, "the first requests ended before the lock: too fast"

    with locked_elsewhere(storage / "metadata.sqlite3"):
        _wait_for_lines(storage, batch_id, total)  # every line ends under the lock
        during = client.get(f"/v1/batches/{batch_id}")
        assert during.status_code == 200, during.text
        assert during.json()["status"] == "in_progress"  # the status last saved; not failed
        health = _wait_for_health(client, 503)  # the refused saves are reported ...
        assert "storage" in health["reason"] and "locked" in health["reason"], health
        create = post_batch(client, spare["id"])  # ... and a create says the storage is the cause
        assert create.status_code == 503, create.text
        assert create.json()["error"]["code"] == "storage_unavailable", create.text
        assert int(create.headers["retry-after"]) >= 1

    batch = wait_for_status(client, batch_id, {"completed", "failed", "cancelled", "expired"})
    assert batch["status"] == "completed", batch
    assert batch["errors"] is None, batch
    assert batch["request_counts"] == {
        "total": total,
        "completed": total - len(failing),
        "failed": len(failing),
    }
    output = file_lines(client, batch["output_file_id"])
    errors = file_lines(client, batch["error_file_id"])
    if error_file == "openai":
        assert batch["error_file_id"] is not None, batch
        assert {line["custom_id"] for line in errors} == {f"r{index}" for index in failing}
    else:
        assert batch["error_file_id"] is None and errors == []
    custom_ids = [line["custom_id"] for line in output + errors]
    assert sorted(custom_ids) == sorted(f"r{index}" for index in range(total)), "each line once"
    failed = {line["custom_id"] for line in output + errors if line["error"] is not None}
    assert failed == {f"r{index}" for index in failing}
    assert _wait_for_health(client, 200) == {"status": "healthy"}
    assert post_batch(client, spare["id"]).status_code == 200
    [event] = receiver.wait_for_deliveries(1)  # the webhook event saved with the status, once
    assert event.event()["type"] == "batch.completed" and event.event()["data"]["id"] == batch_id


@pytest.mark.parametrize(("error_file", "ends"), [("output", "failed"), ("openai", "expired")])
def test_a_batch_whose_window_ends_under_a_lock_ends_once_the_lock_is_gone(
    api_factory: Callable[..., TestClient[Litestar]], tmp_path: Path, error_file: str, ends: str
) -> None:
    """Expiry under the lock: the batch ends as its convention says, with the lines written
    before it ended, each once, and counts that match them."""
    client = api_factory("--simulated-latency-s", "0.3", "--max-pool-size", "1", "--error-file", error_file)
    storage = tmp_path / "storage"
    input_file = upload(client, jsonl(*_lines({3, 6}, 40)))
    # whole seconds: the window ends 2 to 3 s after the create, so after the lock is taken
    batch = post_batch(client, input_file["id"], completion_window="3s").json()
    wait_for_status(client, batch["id"], {"in_progress"})
    with locked_elsewhere(storage / "metadata.sqlite3"):
        time.sleep(4.5)  # the window ends meanwhile
        assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "in_progress"
    ended = wait_for_status(client, batch["id"], {"completed", "failed", "expired", "cancelled"})
    assert ended["status"] == ends, ended
    lines = file_lines(client, ended["output_file_id"]) + file_lines(client, ended["error_file_id"])
    custom_ids = [line["custom_id"] for line in lines]
    assert len(custom_ids) == len(set(custom_ids)) and len(custom_ids) < 40
    failed = sum(1 for line in lines if line["error"] is not None)
    counts = ended["request_counts"]
    assert counts == {"total": 40, "completed": len(lines) - failed, "failed": failed}, (counts, len(lines))


@pytest.mark.parametrize("error_file", ["output", "openai"])
def test_a_batch_cancelled_under_a_lock_ends_cancelled_once_the_lock_is_gone(
    api_factory: Callable[..., TestClient[Litestar]], tmp_path: Path, error_file: str
) -> None:
    client = api_factory("--simulated-latency-s", "30", "--max-pool-size", "1", "--error-file", error_file)
    storage = tmp_path / "storage"
    input_file = upload(client, jsonl(*_lines({1}, 4)))
    batch_id = post_batch(client, input_file["id"]).json()["id"]
    wait_for_status(client, batch_id, {"in_progress"})
    with locked_elsewhere(storage / "metadata.sqlite3"):
        cancel = client.post(f"/v1/batches/{batch_id}/cancel")
        assert cancel.status_code in (200, 503), cancel.text
        if cancel.status_code == 503:
            assert cancel.json()["error"]["code"] == "storage_unavailable"
        time.sleep(1.5)
    if cancel.status_code == 503:
        assert client.post(f"/v1/batches/{batch_id}/cancel").status_code == 200
    batch = wait_for_status(client, batch_id, {"cancelled", "failed", "completed"})
    assert batch["status"] == "cancelled", batch


def test_a_lock_is_logged_once_as_a_storage_fault_with_no_traceback(
    api_factory: Callable[..., TestClient[Litestar]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """During a 3 s lock with a batch running, the server logs a few lines about it, none with a
    traceback, and says in one line when it works again; its core never stops."""
    client = api_factory("--simulated-latency-s", "0.5", "--max-pool-size", "1", "--error-file", "openai")
    storage = tmp_path / "storage"
    batch_id = post_batch(client, upload(client, jsonl(*_lines({2}, 10)))["id"]).json()["id"]
    wait_for_status(client, batch_id, {"in_progress"})
    caplog.clear()
    with caplog.at_level(logging.INFO), locked_elsewhere(storage / "metadata.sqlite3"):
        time.sleep(3)  # requests end meanwhile: their counters wait to be saved
        health = client.get("/health")
        locked_records = list(caplog.records)
    assert health.status_code == 503 and "storage" in health.json()["reason"], health.text
    with_traceback = [record.getMessage() for record in locked_records if record.exc_info]
    assert not with_traceback, with_traceback
    about_it = [
        record.getMessage()
        for record in locked_records
        if record.levelno >= logging.INFO and record.name.startswith("batchgen")  # the server's
    ]
    assert 1 <= len(about_it) <= 2, about_it  # the batch waits to be saved; the flush job waits
    assert _wait_for_health(client, 200) == {"status": "healthy"}
    batch = wait_for_status(client, batch_id, {"completed", "failed", "cancelled"})
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 1, batch
    assert not [record.getMessage() for record in caplog.records if record.exc_info]


def test_an_error_file_still_unrecorded_at_a_stop_is_recorded_on_the_next_start(tmp_path: Path) -> None:
    """The server stops while the lock still holds its batch's first error line unrecorded: the
    next start records the error file it finds on disk, and the batch ends with every line once."""
    storage = tmp_path / "storage"
    flags = ("--simulated-latency-s", "0.4", "--max-pool-size", "1", "--error-file", "openai")
    with ExitStack() as lock, TestClient(in_process_app(storage, *flags), timeout=30) as first:
        batch_id = post_batch(first, upload(first, jsonl(*_lines({1}, 6)))["id"]).json()["id"]
        wait_for_status(first, batch_id, {"in_progress"})
        lock.enter_context(locked_elsewhere(storage / "metadata.sqlite3"))
        _wait_for_lines(storage, batch_id, 2)  # r0's output line and r1's error line
        assert (storage / "incremental" / f"{batch_id}.errors.jsonl").stat().st_size > 0
        # stopped under the lock: the error file's record and the batch's counters are not saved
    with TestClient(in_process_app(storage, *flags), timeout=30) as again:
        batch = wait_for_status(again, batch_id, {"completed", "failed", "cancelled", "expired"})
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
        errors = file_lines(again, batch["error_file_id"])
        assert [line["custom_id"] for line in errors] == ["r1"]
        output = file_lines(again, batch["output_file_id"])
        assert sorted(line["custom_id"] for line in output) == ["r0", "r2", "r3", "r4", "r5"]
