"""A batch's request counts are the same on one server and on replicas: what its lines record.

One real ``batchgen-server`` on its own storage, and two replicas on one PostgreSQL and a shared
folder, all with ``--max-context-length 50``, so that a line too long for it ends in an error
line. The same batch of good and too-long lines, made on one replica and polled on the other,
ends with the request counts it ends with on the single server, and in both those are the lines
of its output and error files that record a completion and a failure. Under both conventions:
error lines with the output (the user guide's) and in an error file of their own (OpenAI's,
``--error-file openai``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import chat_line, create_batch, file_lines, jsonl, upload
from tests.live import LiveServer
from tests.replica_fleet import Blobs, running_replicas

pytestmark = pytest.mark.live

TERMINAL = {"completed", "failed", "cancelled", "expired"}
#: Too many words for ``--max-context-length 50``: the line's request is refused, an error line.
TOO_LONG = "word " * 200
LINES = 120
FAILING = frozenset(line for line in range(LINES) if line % 4 == 1 or line % 9 == 0)


def _input() -> bytes:
    return jsonl(
        *(chat_line(f"r{line}", TOO_LONG if line in FAILING else f"question {line}") for line in range(LINES))
    )


def _ended(client: httpx.Client, batch_id: str, timeout_s: float = 120) -> dict[str, Any]:
    """The batch once ended; a 503 (a replica's database slow to hand it a connection, on a
    loaded machine) is asked again, as docs/api.md says to."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.get(f"/v1/batches/{batch_id}")
        if response.status_code != 503:
            assert response.status_code == 200, response.text
            batch: dict[str, Any] = response.json()
            if batch["status"] in TERMINAL:
                return batch
        assert time.monotonic() < deadline, response.text
        time.sleep(0.1)


def _succeeded(line: dict[str, Any]) -> bool:
    return line["error"] is None and line["response"] is not None and line["response"]["status_code"] < 400


def _run(made_on: httpx.Client, polled_on: httpx.Client, convention: str) -> dict[str, Any]:
    """Run the batch and check it against its files; its request counts."""
    batch = create_batch(made_on, upload(made_on, _input())["id"])
    ended = _ended(polled_on, batch["id"])
    assert ended["status"] == "completed", ended
    output = file_lines(polled_on, ended["output_file_id"])
    errors = file_lines(polled_on, ended["error_file_id"])
    every_line = output + errors
    assert sorted(line["custom_id"] for line in every_line) == sorted(f"r{line}" for line in range(LINES))
    failed = [line for line in every_line if not _succeeded(line)]
    assert {line["custom_id"] for line in failed} == {f"r{line}" for line in FAILING}
    counts: dict[str, Any] = ended["request_counts"]
    assert counts["completed"] == len(every_line) - len(failed) and counts["failed"] == len(failed)
    if convention == "openai":  # the error file holds exactly the failures
        assert (len(output), len(errors)) == (counts["completed"], counts["failed"])
        assert all(map(_succeeded, output))
    else:
        assert ended["error_file_id"] is None
    return counts


@pytest.mark.parametrize("convention", ["output", "openai"])
def test_a_batch_with_error_lines_has_the_same_counts_on_one_server_and_on_replicas(
    server_factory: Callable[..., LiveServer], postgres_url: str, tmp_path: Path, convention: str
) -> None:
    flags = ("--max-context-length", "50", "--error-file", convention)
    single = server_factory(*flags, storage="single")
    with httpx.Client(base_url=single.base_url, timeout=60) as client:
        alone = _run(client, client, convention)
    blobs = Blobs(f"file://{tmp_path / 'shared'}")
    with (
        running_replicas(tmp_path / "replicas", postgres_url, blobs, ("a", "b"), *flags) as servers,
        httpx.Client(base_url=servers[0].base_url, timeout=60) as a,
        httpx.Client(base_url=servers[1].base_url, timeout=60) as b,
    ):
        shared = _run(a, b, convention)
    assert alone == shared == {"total": LINES, "completed": LINES - len(FAILING), "failed": len(FAILING)}
