"""Webhooks: each terminal status sends one signed event, at least once, across failures and kill -9.

The receiver is a real HTTP server on 127.0.0.1 (``tests.webhook_receiver``) that checks signatures
with its own implementation of the Standard Webhooks scheme.
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from batchgen.core import BatchService, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.webhook_outbox import GIVE_UP_AFTER_S, OutboxMessage
from batchgen.server import webhooks
from batchgen.server.cli import settings_from_args
from batchgen.server.webhooks import WebhookDeliverer, signature, signing_key, webhook_headers
from tests.helpers import CHAT, chat_line, create_batch, jsonl, post_batch, upload, wait_for_status
from tests.live import LiveServer, free_port
from tests.webhook_receiver import Received, WebhookReceiver, verify

ApiFactory = Callable[..., TestClient[Litestar]]
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
FAST_RETRY = ("--webhook-retry-initial-s", "0.1")


def _check_event(received: Received, batch_id: str, event_type: str) -> None:
    event = received.event()
    assert set(event) == {"id", "object", "type", "created_at", "data"}
    assert event["object"] == "event" and event["type"] == event_type
    assert event["id"].startswith("evt_") and event["id"] == received.headers["webhook-id"]
    assert event["data"] == {"id": batch_id}
    assert isinstance(event["created_at"], int)
    assert received.headers["content-type"] == "application/json"
    assert int(received.headers["webhook-timestamp"]) >= event["created_at"]


def test_signature_matches_the_standard_webhooks_reference_vector() -> None:
    """The example of the Standard Webhooks libraries: this secret, id, timestamp and payload."""
    key = signing_key(SECRET)
    signed = signature(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert signed == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@pytest.mark.parametrize("secret", [SECRET, "a plain shared secret", "whsec_" + "QUJD"])
def test_headers_verify_with_an_independent_implementation(secret: str) -> None:
    body = b'{"id": "evt_1"}'
    headers = webhook_headers(signing_key(secret), "evt_1", 1700000000, body)
    assert verify(secret, Received(headers, body, 204))
    assert not verify(secret, Received(headers, body + b" ", 204)), "a changed body must not verify"


@pytest.mark.parametrize("secret", ["", "whsec_", "whsec_not base64!"])
def test_a_malformed_secret_is_refused(secret: str) -> None:
    with pytest.raises(ValueError, match="webhook-secret"):
        signing_key(secret)


@pytest.mark.parametrize("url", ["ftp://example.com/hook", "example.com/hook", "http://", "http://a b/"])
def test_a_bad_webhook_url_flag_is_refused(api_factory: ApiFactory, url: str) -> None:
    with pytest.raises(ValueError, match="--webhook-url"):
        api_factory("--webhook-url", url)


@pytest.mark.parametrize(
    ("event_type", "flags", "window", "latency"),
    [
        ("batch.completed", (), "24h", "0"),
        ("batch.failed", (), "1s", "0.3"),  # the guide: a batch past its window fails
        ("batch.expired", ("--error-file", "openai"), "1s", "0.3"),
        ("batch.cancelled", (), "24h", "60"),
    ],
)
def test_each_terminal_status_sends_one_signed_event(
    api_factory: ApiFactory, event_type: str, flags: tuple[str, ...], window: str, latency: str
) -> None:
    with WebhookReceiver() as receiver:
        client = api_factory(
            "--webhook-url",
            receiver.url,
            "--webhook-secret",
            SECRET,
            "--simulated-latency-s",
            latency,
            "--max-pool-size",
            "1",
            *flags,
        )
        lines = 3 if event_type == "batch.completed" else 40
        batch = create_batch(
            client,
            upload(client, jsonl(*[chat_line(f"r{i}") for i in range(lines)]))["id"],
            completion_window=window,
        )
        if event_type == "batch.cancelled":
            wait_for_status(client, batch["id"], {"in_progress"})
            client.post(f"/v1/batches/{batch['id']}/cancel").raise_for_status()
        ended = wait_for_status(
            client, batch["id"], {"completed", "failed", "expired", "cancelled"}, timeout_s=30
        )
        assert f"batch.{ended['status']}" == event_type
        # a batch that cannot finish in its window is announced at risk first (batch.at_risk)
        deliveries = receiver.wait_for_deliveries(1)
        while not any(received.event()["type"] == event_type for received in deliveries):
            deliveries = receiver.wait_for_deliveries(len(deliveries) + 1)
        [delivered] = [received for received in deliveries if received.event()["type"] == event_type]
        assert {received.event()["type"] for received in deliveries} <= {event_type, "batch.at_risk"}
        _check_event(delivered, batch["id"], event_type)
        assert verify(SECRET, delivered)


def test_a_failing_receiver_gets_the_same_event_until_it_accepts(api_factory: ApiFactory) -> None:
    with WebhookReceiver(fail_first=3) as receiver:
        client = api_factory("--webhook-url", receiver.url, "--webhook-secret", SECRET, *FAST_RETRY)
        batch = create_batch(client, upload(client, jsonl(chat_line("a"), chat_line("b")))["id"])
        receiver.wait_for_deliveries(1)
        assert [request.answered for request in receiver.received] == [500, 500, 500, 204]
        assert len({request.headers["webhook-id"] for request in receiver.received}) == 1
        assert len({request.body for request in receiver.received}) == 1, "every attempt sends the same event"
        assert all(verify(SECRET, request) for request in receiver.received)
        _check_event(receiver.received[-1], batch["id"], "batch.completed")
        assert _metric(client, "batchgen_webhook_outbox_messages") == 0, "a delivered event leaves the outbox"


def test_every_configured_url_gets_the_event(api_factory: ApiFactory) -> None:
    with WebhookReceiver() as first, WebhookReceiver(fail_first=1) as second:
        client = api_factory("--webhook-url", first.url, "--webhook-url", second.url, *FAST_RETRY)
        batch = create_batch(client, upload(client, jsonl(chat_line("a")))["id"])
        [one] = first.wait_for_deliveries(1)
        [two] = second.wait_for_deliveries(1)
        assert one.body == two.body and one.event()["data"]["id"] == batch["id"]
        assert "webhook-signature" not in one.headers, "no secret: sent unsigned"


def test_a_batch_may_name_its_own_url_when_the_server_allows_it(api_factory: ApiFactory) -> None:
    with WebhookReceiver() as server_hook, WebhookReceiver() as batch_hook:
        allowing = api_factory("--webhook-url", server_hook.url, "--webhook-batch-urls", storage="allowing")
        file_id = upload(allowing, jsonl(chat_line("a")))["id"]
        bad = post_batch(allowing, file_id, metadata={"webhook_url": "file:///etc/passwd"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.webhook_url"
        own = create_batch(allowing, file_id, metadata={"webhook_url": batch_hook.url})
        [delivered] = batch_hook.wait_for_deliveries(1)
        assert delivered.event()["data"]["id"] == own["id"]

        strict = api_factory("--webhook-url", server_hook.url, storage="strict")
        plain = create_batch(
            strict, upload(strict, jsonl(chat_line("a")))["id"], metadata={"webhook_url": batch_hook.url}
        )
        [to_server] = server_hook.wait_for_deliveries(1)
        assert to_server.event()["data"]["id"] == plain["id"], (
            "without the flag the metadata is only metadata"
        )
        assert len(batch_hook.delivered()) == 1


def test_the_secret_is_read_from_the_environment_and_switches_default_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHGEN_WEBHOOK_SECRET", SECRET)
    assert settings_from_args(["--backend", "simulated"]).webhook_secret == SECRET
    given = settings_from_args(["--backend", "simulated", "--webhook-secret", "other"])
    assert given.webhook_secret == "other"
    assert SECRET not in repr(given), "the secret is kept out of the settings' repr"
    assert given.webhook_batch_urls is False and given.access_log is False
    switched = settings_from_args(["--backend", "simulated", "--webhook-batch-urls", "--access-log"])
    assert switched.webhook_batch_urls is True and switched.access_log is True


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def _outbox(storage_path: Path) -> list[tuple[str, str, int]]:
    with sqlite3.connect(storage_path / "metadata.sqlite3") as db:
        return list(db.execute("SELECT event_id, target, attempts FROM webhook_outbox"))


def test_an_event_not_delivered_before_kill_9_is_delivered_after_restart(
    server_factory: Callable[..., LiveServer],
) -> None:
    port = free_port()  # nothing listens there yet: the receiver is down when the batch ends
    url = f"http://127.0.0.1:{port}/hooks/batchgen"
    flags = ("--webhook-url", url, "--webhook-secret", SECRET, "--webhook-retry-initial-s", "0.3")
    server = server_factory(*flags, storage="kept")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch = create_batch(client, upload(client, jsonl(chat_line("a"), chat_line("b")))["id"])
        wait_for_status(client, batch["id"], {"completed"})
        deadline = time.monotonic() + 30
        while not (pending := _outbox(server.storage_path)) or pending[0][2] < 1:
            assert time.monotonic() < deadline, "the event was not tried"
            time.sleep(0.05)
    [(event_id, target, _)] = pending
    assert target == url
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=30)

    with WebhookReceiver(port) as receiver:
        server_factory(*flags, storage="kept")
        [delivered] = receiver.wait_for_deliveries(1)
        assert delivered.headers["webhook-id"] == event_id
        _check_event(delivered, batch["id"], "batch.completed")
        assert verify(SECRET, delivered)
        deadline = time.monotonic() + 30
        while _outbox(server.storage_path):
            assert time.monotonic() < deadline, "the delivered event stayed in the outbox"
            time.sleep(0.05)
        assert len(receiver.received) == 1


def test_an_event_undelivered_for_a_day_is_given_up_with_an_error_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The deliverer's clock is moved a day on: the next failure drops the message and logs why."""

    async def scenario(receiver: WebhookReceiver) -> tuple[list[OutboxMessage], list[OutboxMessage]]:
        settings = ServiceSettings(storage_path=tmp_path, webhook_urls=(receiver.url,))
        async with BatchService(settings, SimulatedBackend()) as service:
            batch = await service.create_batch((await service.create_file(jsonl(chat_line("a")))).id, CHAT)
            await service.wait_for_batch(batch.id)
            now = [time.time()]
            deliverer = WebhookDeliverer(service, secret=SECRET, retry_initial_s=60, clock=lambda: now[0])
            await deliverer.deliver_due()  # fails: rescheduled a minute or so later
            waiting = service.metadata.due_webhooks(float("inf"), 10)
            now[0] += GIVE_UP_AFTER_S
            await deliverer.deliver_due()  # fails again, a day after the event: given up
            assert (deliverer.counts.failed, deliverer.counts.abandoned, deliverer.counts.delivered) == (
                2,
                1,
                0,
            )
            return waiting, service.metadata.due_webhooks(float("inf"), 10)

    with WebhookReceiver(fail_first=100) as receiver, caplog.at_level(logging.ERROR, "batchgen.webhooks"):
        waiting, left = anyio.run(scenario, receiver)
    [message] = waiting
    assert (
        message.attempts == 1 and message.last_error == "HTTP 500" and message.next_attempt_at > time.time()
    )
    assert left == [], "a message given up leaves the outbox"
    assert len(receiver.received) == 2
    [record] = [r for r in caplog.records if "given up" in r.getMessage()]
    assert message.event_id in record.getMessage() and "HTTP 500" in record.getMessage()


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("drip", ["body", "headers"])
def test_a_slow_receiver_holds_back_no_other_target(api_factory: ApiFactory, drip: str) -> None:
    """One URL answers a byte at a time and its attempt is still going; the other URL gets every
    event meanwhile, the ones made after the slow attempt began included."""
    with WebhookReceiver(drip=drip) as slow, WebhookReceiver() as normal:
        client = api_factory(
            "--webhook-url", slow.url, "--webhook-url", normal.url, "--webhook-timeout-s", "300"
        )
        first = create_batch(client, upload(client, jsonl(chat_line("a")))["id"])
        normal.wait_for_deliveries(1)
        _wait(lambda: len(slow.received) == 1, "the slow receiver was not tried")
        later = [create_batch(client, upload(client, jsonl(chat_line(f"b{i}")))["id"]) for i in range(3)]
        delivered = normal.wait_for_deliveries(4)
        assert sorted(r.event()["data"]["id"] for r in delivered) == sorted(b["id"] for b in [first, *later])
        assert len(slow.received) == 1 and slow.hangups == 0, "the slow attempt is still going"
        assert slow.received[0].event()["data"]["id"] == first["id"]


@pytest.mark.parametrize("drip", ["body", "headers"])
def test_an_attempt_has_one_deadline_for_all_of_it(
    api_factory: ApiFactory, tmp_path: Path, drip: str
) -> None:
    """A receiver that keeps sending a byte now and then never lets a per-read timeout fire; the
    attempt is still cut at ``--webhook-timeout-s`` and the event is tried again later."""
    with WebhookReceiver(drip=drip, drip_s=0.1) as slow:
        client = api_factory("--webhook-url", slow.url, "--webhook-timeout-s", "1", *FAST_RETRY)
        create_batch(client, upload(client, jsonl(chat_line("a")))["id"])
        _wait(lambda: slow.hangups >= 1, "the slow attempt was never cut off")
        _wait(lambda: len(slow.received) >= 2, "the cut-off event was not tried again")
        assert len({r.headers["webhook-id"] for r in slow.received}) == 1
        [(_, _, attempts)] = _outbox(tmp_path / "storage")
        assert attempts >= 1
        with sqlite3.connect(tmp_path / "storage" / "metadata.sqlite3") as db:
            [(last_error,)] = db.execute("SELECT last_error FROM webhook_outbox")
        assert "within 1 s" in last_error


def test_one_targets_events_go_one_at_a_time_in_order(api_factory: ApiFactory) -> None:
    with WebhookReceiver(delay_s=0.3) as receiver:
        client = api_factory("--webhook-url", receiver.url)
        batches = []
        for i in range(4):
            batch = create_batch(client, upload(client, jsonl(chat_line(f"r{i}")))["id"])
            batches.append(wait_for_status(client, batch["id"], {"completed"}))
        delivered = receiver.wait_for_deliveries(4)
        assert receiver.most_at_once == 1, "one URL has one attempt in flight at a time"
        assert [r.event()["data"]["id"] for r in delivered] == [b["id"] for b in batches]


def test_a_urls_credentials_never_reach_the_logs_metrics_or_errors(
    api_factory: ApiFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Userinfo and a secret query value, on a URL that fails then works and on one that is
    refused outright; every record at every level, /metrics and the flag's refusal are clean."""
    password, token = "pw-S3CRET-1", "tok-S3CRET-2"
    with WebhookReceiver(fail_first=1) as receiver, caplog.at_level(logging.DEBUG):
        url = receiver.url.replace("://", f"://hook-user:{password}@") + f"?token={token}&tenant=t1"
        refused = f"http://admin:{password}@127.0.0.1:{free_port()}/down?api_key={token}"
        client = api_factory("--webhook-url", url, "--webhook-url", refused, *FAST_RETRY)
        create_batch(client, upload(client, jsonl(chat_line("a")))["id"])
        [delivered] = receiver.wait_for_deliveries(1)
        assert delivered.headers["authorization"].startswith("Basic "), "the URL itself is used as given"
        _wait(
            lambda: any("failed" in r.getMessage() and "/down" in r.getMessage() for r in caplog.records),
            "the refused URL's failure was not logged",
        )
        metrics_text = client.get("/metrics").text
        with pytest.raises(ValueError) as bad_flag:
            api_factory("--webhook-url", f"ftp://u:{password}@example.com/?secret={token}", storage="bad")
    logged = [record.getMessage() + repr(record.__dict__) for record in caplog.records]
    assert any("hook-user" not in line and "***@127.0.0.1" in line for line in logged)
    for secret in (password, token):
        assert not [line for line in logged if secret in line], f"{secret} reached the log"
        assert secret not in metrics_text
        assert secret not in str(bad_flag.value)


def test_attempts_in_flight_are_bounded_across_targets(
    api_factory: ApiFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for two attempts at once, three stuck URLs get two attempts between them (none cut
    off yet), and the third is tried once one of those has been cut off at the deadline."""
    monkeypatch.setattr(webhooks, "MAX_TARGETS_IN_FLIGHT", 2)
    with (
        WebhookReceiver(drip="body") as one,
        WebhookReceiver(drip="body") as two,
        WebhookReceiver(drip="body") as three,
    ):
        stuck = (one, two, three)
        flags = [flag for receiver in stuck for flag in ("--webhook-url", receiver.url)]
        client = api_factory(*flags, "--webhook-timeout-s", "3", "--webhook-retry-initial-s", "60")
        create_batch(client, upload(client, jsonl(chat_line("a")))["id"])
        _wait(lambda: sum(len(r.received) for r in stuck) == 2, "two attempts did not start")
        assert sum(r.hangups for r in stuck) == 0 and sum(len(r.received) for r in stuck) == 2
        _wait(lambda: all(r.received for r in stuck), "the third URL was never tried")
        _wait(lambda: sum(r.hangups for r in stuck) >= 1, "no attempt was cut off to make room")
