"""kill -9 in the middle of an ordered rewrite, then a restart: nothing half-made is ever served.

A batch large enough that its rewrite takes a visible moment: the test waits for the ordered copy
(``{output}.ordering``) to appear, kills the server with SIGKILL while it is being written, and
checks the file the batch's ``output_file_id`` names is still the whole appended file. After a
restart the rewrite runs again and the batch completes with exactly one line per custom_id, in
input order, and no copy left behind.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.helpers import TERMINAL, chat_line, create_batch, upload, wait_for_status, write_jsonl
from tests.live import LiveServer

TOTAL = 150_000
FLAGS = ("--max-pool-size", "2048", "--output-order", "input")


def _ids(data: bytes) -> list[str]:
    return [json.loads(line)["custom_id"] for line in data.splitlines()]


def test_a_kill_during_the_ordered_rewrite_serves_no_half_made_file(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    expected = [f"r{n}" for n in range(TOTAL)]
    input_path = write_jsonl(
        tmp_path / "in.jsonl", (chat_line(custom_id, "hi", max_tokens=1) for custom_id in expected)
    )
    server = server_factory(*FLAGS, storage="ordered")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        batch = create_batch(client, upload(client, input_path)["id"])
    assert batch["output_order"] == "input"
    output = server.storage_path / "incremental" / f"{batch['id']}.jsonl"
    copy = output.with_name(output.name + ".ordering")
    deadline = time.monotonic() + 300
    while not (copy.exists() and copy.stat().st_size > 0):
        assert server.process.poll() is None and time.monotonic() < deadline, "the rewrite never started"
        time.sleep(0.0005)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=30)
    assert copy.exists(), "the rewrite had finished before the kill; the test proves nothing"
    appended = output.read_bytes()
    assert appended.endswith(b"\n") and sorted(_ids(appended)) == sorted(expected)  # whole, every line once
    assert _ids(appended) != expected, "the requests finished in input order; the test proves nothing"
    assert copy.stat().st_size < len(appended), "the copy was complete; the test proves nothing"

    server = server_factory(*FLAGS, storage="ordered")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        batch = wait_for_status(client, batch["id"], TERMINAL, timeout_s=300)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": TOTAL, "completed": TOTAL, "failed": 0}
        served = client.get(f"/v1/files/{batch['output_file_id']}/content")
    assert served.status_code == 200
    assert _ids(served.content) == expected  # every custom_id once, in input order
    assert sorted(served.content.splitlines()) == sorted(appended.splitlines())  # the same lines
    assert not copy.exists()
