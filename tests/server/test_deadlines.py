"""Deadlines on a live server (simulated backend with latency, so the order of admission shows).

- A tenant's batch with a 1 h window created behind its own 7 d batch finishes first, although
  it is the bigger one (taking turns, it would finish last), while another tenant's share of the
  finished requests stays what it is when both batches have 7 d (and then the later one does not
  overtake).
- A batch that cannot finish in its window says ``at_risk`` (REST, the ``openai`` SDK, both
  clients, ``batchgen status``), ``/metrics`` counts it, and exactly one ``batch.at_risk`` event
  reaches the webhook receiver, also across a kill -9 and a restart that resumes the batch.
- A batch with a ``1s`` window on a server too slow to finish it ends timed out, but not before a
  whole second has passed since the test asked for it (its ``expires_at`` says so too: the window
  counts from the exact moment of its creation, not from the whole second ``created_at`` shows).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from batchgen.client import AsyncBatchGenClient, BatchGenHttpClient
from batchgen.client.cli import main as batchgen_main
from tests.helpers import chat_line, create_batch, jsonl, upload, wait_for_status
from tests.keys import authorized, create_key
from tests.live import LiveServer
from tests.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.live

#: The 1 h batch is the bigger one: taking turns with the 7 d batch, it would finish last.
FAR_LINES, NEAR_LINES, OTHER_LINES = 150, 200, 1500


def _batch(client: httpx.Client, prefix: str, lines: int, window: str) -> str:
    file_id = upload(client, jsonl(*[chat_line(f"{prefix}-{i}") for i in range(lines)]))["id"]
    return str(create_batch(client, file_id, completion_window=window)["id"])


def _done(client: httpx.Client, batch_id: str) -> tuple[int, str]:
    batch = client.get(f"/v1/batches/{batch_id}").json()
    counts = batch["request_counts"]
    return counts["completed"] + counts["failed"], batch["status"]


def _run(server_factory: Callable[..., LiveServer], storage: str, near_window: str) -> dict[str, Any]:
    """Tenant A: a 7 d batch, then (once tenant B's big batch runs too) one of ``near_window``.
    Returns which of A's batches ended first, and B's share of the requests finished while A's
    second batch ran."""
    server = server_factory("--max-pool-size", "2", "--simulated-latency-s", "0.02", storage=storage)
    _, key_a = create_key(server.storage_path, "tenant-a")
    _, key_b = create_key(server.storage_path, "tenant-b")
    with authorized(server.base_url, key_a) as a, authorized(server.base_url, key_b) as b:
        far = _batch(a, "far", FAR_LINES, "7d")
        wait_for_status(a, far, {"in_progress"})
        other = _batch(b, "other", OTHER_LINES, "24h")
        wait_for_status(b, other, {"in_progress"})
        near = _batch(a, "near", NEAR_LINES, near_window)
        start_a = _done(a, far)[0] + _done(a, near)[0]
        start_b = _done(b, other)[0]
        first = None
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "tenant A's batches did not finish"
            (far_done, far_status), (near_done, near_status) = _done(a, far), _done(a, near)
            other_done, other_status = _done(b, other)
            assert other_status == "in_progress", "B's batch must outlast A's second batch"
            if first is None and "completed" in (far_status, near_status):
                first = "near" if near_status == "completed" else "far"
                far_left = FAR_LINES - far_done
            if near_status == "completed":
                a_meanwhile = far_done + near_done - start_a
                b_meanwhile = other_done - start_b
                break
            time.sleep(0.05)
        b.post(f"/v1/batches/{other}/cancel")
        a.post(f"/v1/batches/{far}/cancel")
    server.stop()
    return {"first": first, "far_left": far_left, "b_share": b_meanwhile / (a_meanwhile + b_meanwhile)}


def test_a_1h_batch_behind_a_7d_batch_finishes_first_and_other_tenants_keep_their_share(
    server_factory: Callable[..., LiveServer],
) -> None:
    with_deadline = _run(server_factory, "deadlines", "1h")
    without = _run(server_factory, "same-window", "7d")
    assert with_deadline["first"] == "near" and with_deadline["far_left"] > 0, with_deadline
    # same window: the 7 d batch created first keeps the lead (as it would taking turns)
    assert without["first"] == "far", without
    # tenant B gets half the admissions while A has work, whichever of A's batches runs
    for run in (with_deadline, without):
        assert 0.4 <= run["b_share"] <= 0.6, (with_deadline, without)
    assert abs(with_deadline["b_share"] - without["b_share"]) <= 0.1, (with_deadline, without)


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} is not in /metrics"
    return float(match.group(1))


def _at_risk_ids(receiver: WebhookReceiver) -> list[str]:
    events = [received.event() for received in receiver.delivered()]
    return [event["id"] for event in events if event["type"] == "batch.at_risk"]


def test_a_batch_that_cannot_finish_in_time_is_at_risk_and_sends_one_event_across_kill_9(
    server_factory: Callable[..., LiveServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with WebhookReceiver() as receiver:
        flags = (
            "--max-pool-size", "1", "--simulated-latency-s", "0.25",
            "--webhook-url", receiver.url, "--webhook-retry-initial-s", "0.2",
        )  # fmt: skip
        server = server_factory(*flags, storage="kept")
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            # 120 requests of 0.25 s on one slot: 30 s of work in a 20 s window
            batch_id = _batch(client, "late", 120, "20s")
            deadline = time.monotonic() + 15
            while not client.get(f"/v1/batches/{batch_id}").json()["at_risk"]:
                assert time.monotonic() < deadline, "the batch was never found at risk"
                time.sleep(0.05)
            assert _metric(server.base_url, "batchgen_batches_at_risk") == 1
            page = httpx.get(f"{server.base_url}/").text  # the dashboard, rendered with its batches
            [row] = [row for row in page.split("<tr") if f'data-batch-id="{batch_id}"' in row]
            assert 'data-at-risk="true"' in row and 'class="at-risk"' in row
            receiver.wait_for_deliveries(1, timeout_s=15)
            [event_id] = set(_at_risk_ids(receiver))
            assert all(r.event()["data"] == {"id": batch_id} for r in receiver.delivered())

            with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as sdk:
                assert (sdk.batches.retrieve(batch_id).model_extra or {})["at_risk"] is True
            with BatchGenHttpClient(server.base_url) as sync_client:
                assert sync_client.get_batch(batch_id)["at_risk"] is True

            async def read_async() -> Any:
                async with AsyncBatchGenClient(server.base_url) as async_client:
                    return (await async_client.get_batch(batch_id))["at_risk"]

            assert anyio.run(read_async) is True
            assert batchgen_main(["--base-url", server.base_url, "status", batch_id]) == 0
            shown = capsys.readouterr()
            assert '"at_risk": true' in shown.out and "AT RISK" in shown.err

        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        server = server_factory(*flags, storage="kept")
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            deadline = time.monotonic() + 15
            while not client.get(f"/v1/batches/{batch_id}").json()["at_risk"]:  # resumed, at risk again
                assert time.monotonic() < deadline, "the resumed batch was never found at risk"
                time.sleep(0.05)
            time.sleep(1.5)  # several checks of the deadline watch
            assert set(_at_risk_ids(receiver)) == {event_id}, "a second at-risk event was made"
            client.post(f"/v1/batches/{batch_id}/cancel")
            ended = wait_for_status(client, batch_id, {"cancelled"})
            assert ended["at_risk"] is False
            assert _metric(server.base_url, "batchgen_batches_at_risk") == 0
            receiver.wait_for_deliveries(2, timeout_s=15)  # the cancel's event
            assert set(_at_risk_ids(receiver)) == {event_id}


def test_a_one_second_window_is_never_cut_short(server_factory: Callable[..., LiveServer]) -> None:
    """A ``1s`` batch on a server too slow to finish it ends timed out, but never before a whole
    second has passed since it was created (its times are whole seconds; its window is not)."""
    server = server_factory("--simulated-latency-s", "60")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        file_id = upload(client, jsonl(chat_line("slow-0"), chat_line("slow-1")))["id"]
        sent = time.time()  # the batch is created after this, on the same clock
        batch = create_batch(client, file_id, completion_window="1s")
        assert batch["expires_at"] >= sent + 1, batch  # its window counts from its exact creation
        deadline = time.monotonic() + 60
        while True:
            seen = client.get(f"/v1/batches/{batch['id']}").json()
            answered = time.time()  # the batch was seen so before this
            if seen["status"] != "in_progress" and seen["status"] != "validating":
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        assert answered >= sent + 1, f"ended {answered - sent:.3f} s after it was asked for: {seen}"
    assert seen["status"] == "failed" and "timed out" in seen["errors"]["data"][0]["message"], seen
    assert seen["failed_at"] >= seen["expires_at"] >= seen["created_at"] + 1
