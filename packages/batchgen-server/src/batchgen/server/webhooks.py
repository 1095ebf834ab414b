"""Webhook delivery: send the outbox's due messages, signed as the Standard Webhooks spec says.

The service saves a batch's terminal event in its outbox in the same write as the status
(``batchgen.core.webhook_outbox``); ``WebhookDeliverer.deliver_due`` runs as one of the service's
supervised maintenance jobs and POSTs what is due. Each request carries

    webhook-id: evt_…                   (the event id: the same on every attempt)
    webhook-timestamp: 1719168000       (seconds, when this attempt was signed)
    webhook-signature: v1,<base64>      (HMAC-SHA256 over "{id}.{timestamp}.{body}")

A 2xx answer delivers the message (it is removed); anything else, a timeout or a connection
error reschedules it with exponential backoff and jitter, for a day after the event was made, and
then it is dropped with an error log. Delivery is at least once: a receiver drops repeats by
``webhook-id``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import random
import time
from collections.abc import Callable

import anyio
import attrs
import httpx

from batchgen.core.service import BatchService
from batchgen.core.webhook_outbox import GIVE_UP_AFTER_S, OutboxMessage, retry_delay_s

logger = logging.getLogger("batchgen.webhooks")

#: Messages sent at once per run of the job.
MAX_MESSAGES_PER_RUN = 64
SECRET_PREFIX = "whsec_"


def signing_key(secret: str) -> bytes:
    """The HMAC key of a secret: ``whsec_`` + base64 (Standard Webhooks) is decoded; any other
    string is used as its UTF-8 bytes. ValueError for an empty secret or bad base64."""
    if not secret:
        raise ValueError("--webhook-secret must not be empty")
    if secret.startswith(SECRET_PREFIX):
        try:
            key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
        except binascii.Error as exc:
            raise ValueError("--webhook-secret: the part after whsec_ must be base64") from exc
        if not key:
            raise ValueError("--webhook-secret: the key after whsec_ is empty")
        return key
    return secret.encode()


def signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def webhook_headers(key: bytes | None, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        "user-agent": "batchgen-webhooks",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
    }
    if key is not None:
        headers["webhook-signature"] = signature(key, message_id, timestamp, body)
    return headers


@attrs.define
class DeliveryCounts:
    """Attempts since start, by outcome (read by /metrics)."""

    delivered: int = 0
    failed: int = 0
    abandoned: int = 0


class WebhookDeliverer:
    """Sends the outbox's due messages of one service."""

    def __init__(
        self,
        service: BatchService,
        *,
        secret: str | None,
        timeout_s: float = 10.0,
        retry_initial_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._service = service
        self._key = None if secret is None else signing_key(secret)
        self._timeout_s = timeout_s
        self._retry_initial_s = retry_initial_s
        self._clock = clock
        self._transport = transport
        self._rng = random.Random()
        self.counts = DeliveryCounts()

    async def deliver_due(self) -> None:
        """Send every due message (up to ``MAX_MESSAGES_PER_RUN``), at once, and record each outcome."""
        metadata = self._service.metadata
        due = metadata.due_webhooks(self._clock(), MAX_MESSAGES_PER_RUN)
        if not due:
            return
        async with (
            httpx.AsyncClient(timeout=self._timeout_s, transport=self._transport) as client,
            anyio.create_task_group() as tasks,
        ):
            for message in due:
                tasks.start_soon(self._deliver, client, message)

    async def _deliver(self, client: httpx.AsyncClient, message: OutboxMessage) -> None:
        error = await self._send(client, message)
        metadata = self._service.metadata
        if error is None:
            metadata.delete_webhook(message.event_id, message.target)
            self.counts.delivered += 1
            logger.info(
                "webhook %s delivered to %s",
                message.event_id,
                message.target,
                extra={"event": "webhook.delivered", "event_id": message.event_id},
            )
            return
        self.counts.failed += 1
        attempts = message.attempts + 1
        now = self._clock()
        next_at = now + retry_delay_s(attempts, self._retry_initial_s, self._rng)
        if next_at - message.created_at > GIVE_UP_AFTER_S:
            metadata.delete_webhook(message.event_id, message.target)
            self.counts.abandoned += 1
            logger.error(
                "webhook %s to %s given up after %d attempts over a day: %s",
                message.event_id,
                message.target,
                attempts,
                error,
                extra={"event": "webhook.abandoned", "event_id": message.event_id},
            )
            return
        metadata.reschedule_webhook(
            attrs.evolve(message, attempts=attempts, next_attempt_at=next_at, last_error=error)
        )
        log = logger.warning if attempts == 1 else logger.debug
        log(
            "webhook %s to %s failed (attempt %d, next in %.0f s): %s",
            message.event_id,
            message.target,
            attempts,
            next_at - now,
            error,
            extra={"event": "webhook.failed", "event_id": message.event_id},
        )

    async def _send(self, client: httpx.AsyncClient, message: OutboxMessage) -> str | None:
        """POST the message once; None when delivered, else why not."""
        headers = webhook_headers(self._key, message.event_id, int(self._clock()), message.body)
        try:
            response = await client.post(message.target, content=message.body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if 200 <= response.status_code < 300:
            return None
        return f"HTTP {response.status_code}"
