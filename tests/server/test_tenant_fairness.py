"""Fair admission across tenants on a live server (simulated backend with latency, two slots).

Tenant A queues ten big batches (4,000 requests); tenant B then submits one of 20. Admission is
fair across tenants first, so B gets every other freed slot, not one in eleven as a round-robin
over batches alone would give it: B's batch finishes while A's work is still queued, and by then
A has finished about as many requests as B, far fewer than the ten-to-one share it would have
had otherwise.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.helpers import chat_line, jsonl, upload, wait_for_status
from tests.keys import authorized, create_key
from tests.live import start_server

pytestmark = pytest.mark.live
A_BATCHES, A_LINES, B_LINES = 10, 400, 20


def test_a_small_batch_finishes_while_another_tenants_huge_work_is_queued(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    _, key_a = create_key(storage, "tenant-a")
    _, key_b = create_key(storage, "tenant-b")
    server = start_server(storage, "--max-pool-size", "2", "--simulated-latency-s", "0.02")
    try:
        with authorized(server.base_url, key_a) as a, authorized(server.base_url, key_b) as b:
            batches_a = []
            for number in range(A_BATCHES):
                lines = [chat_line(f"a-{number}-{i}") for i in range(A_LINES)]
                file_id = upload(a, jsonl(*lines))["id"]
                created = a.post(
                    "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
                )
                assert created.status_code == 200, created.text
                batches_a.append(created.json()["id"])
            for batch_id in batches_a:
                wait_for_status(a, batch_id, {"in_progress"})
            with openai.OpenAI(base_url=server.api_url, api_key=key_b, max_retries=0) as sdk:
                small = sdk.files.create(
                    file=("b.jsonl", jsonl(*[chat_line(f"b-{i}") for i in range(B_LINES)])), purpose="batch"
                )
                batch_b = sdk.batches.create(
                    input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                a_before = sum(
                    a.get(f"/v1/batches/{i}").json()["request_counts"]["completed"] for i in batches_a
                )
                done = wait_for_status(b, batch_b.id, {"completed", "failed"}, timeout_s=120)
            a_after = [a.get(f"/v1/batches/{i}").json() for i in batches_a]
            assert done["status"] == "completed"
            assert done["request_counts"]["completed"] == B_LINES
            assert all(batch["status"] == "in_progress" for batch in a_after)
            a_meanwhile = sum(batch["request_counts"]["completed"] for batch in a_after) - a_before
            # fair across tenants: about B_LINES; across batches only, it would be about 10 * B_LINES
            assert a_meanwhile < 5 * B_LINES, a_meanwhile
            status = a.get("/v1/pool/status").json()
            assert (
                status["tenants"] == [{**status["tenants"][0], "tenant": "tenant-a"}]
                and status["tenants"][0]["queued_requests"] > 0
            )
    finally:
        server.stop()
