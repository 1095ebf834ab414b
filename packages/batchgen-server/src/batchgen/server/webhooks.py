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

Targets do not wait for each other. Each URL has at most one attempt in flight and gets its due
messages one at a time, in the order they became due; different URLs are sent to at once (at most
``MAX_TARGETS_IN_FLIGHT``), and while one is in flight the others' new events keep going out. Each
attempt has one deadline, ``timeout_s``, for all of it (connecting, sending, the answer's headers
and body): a receiver that answers a byte at a time is cut off there like one that never answers.
A URL's credentials (userinfo, a ``?token=``) never reach the log: it is logged redacted.
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
from batchgen.core.url_redaction import redact_logger, redact_url, redact_urls_in
from batchgen.core.webhook_outbox import GIVE_UP_AFTER_S, OutboxMessage, retry_delay_s

logger = logging.getLogger("batchgen.webhooks")

#: Due messages looked at each time the outbox is read.
MAX_MESSAGES_PER_RUN = 64
#: Targets (URLs) with an attempt in flight at once, at most.
MAX_TARGETS_IN_FLIGHT = 32
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


_Key = tuple[str, str]  # (event id, target)


class WebhookDeliverer:
    """Sends the outbox's due messages of one service."""

    def __init__(
        self,
        service: BatchService,
        *,
        secret: str | None,
        timeout_s: float = 10.0,
        retry_initial_s: float = 5.0,
        poll_interval_s: float = 0.25,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        redact_logger("httpx")  # it logs every request's URL, userinfo and query included
        self._service = service
        self._key = None if secret is None else signing_key(secret)
        self._timeout_s = timeout_s
        self._retry_initial_s = retry_initial_s
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._transport = transport
        self._rng = random.Random()
        self._in_flight: set[str] = set()
        # outcomes the store could not take yet (a locked database): None for delivered (to be
        # deleted), else the rescheduled message; such a message is not sent again meanwhile
        self._unsaved: dict[_Key, OutboxMessage | None] = {}
        self.counts = DeliveryCounts()

    async def deliver_due(self) -> None:
        """Send what is due, each target on its own, until nothing is due or in flight.

        A target with an attempt in flight is left out of the next look at the outbox, so the
        other targets' messages (new ones too) keep going out while it answers slowly.
        """
        if not await self._save_outcomes() or not await self._due():
            return
        async with (
            httpx.AsyncClient(timeout=self._timeout_s, transport=self._transport) as client,
            anyio.create_task_group() as tasks,
        ):
            while True:
                for target, messages in (await self._due_by_target()).items():
                    self._in_flight.add(target)
                    tasks.start_soon(self._deliver_all, client, target, messages)
                if not self._in_flight:
                    return
                await anyio.sleep(self._poll_interval_s)
                await self._save_outcomes()

    async def _due(self) -> list[OutboxMessage]:
        free = MAX_TARGETS_IN_FLIGHT - len(self._in_flight)
        if free <= 0:
            return []
        service = self._service
        due = await service.parts.calls(
            service.metadata.due_webhooks,
            self._clock(),
            MAX_MESSAGES_PER_RUN,
            skip_targets=frozenset(self._in_flight),  # a copy: the set changes while a thread reads
        )
        return [message for message in due if (message.event_id, message.target) not in self._unsaved]

    async def _due_by_target(self) -> dict[str, list[OutboxMessage]]:
        """Due messages of targets with nothing in flight (at most as many targets as may start)."""
        try:
            due = await self._due()
        except Exception as exc:  # a storage fault: the sends in flight go on; looked at again later
            if not self._in_flight:
                raise
            logger.warning("webhook outbox not read: %s", exc)
            return {}
        by_target: dict[str, list[OutboxMessage]] = {}
        free = MAX_TARGETS_IN_FLIGHT - len(self._in_flight)
        for message in due:
            if message.target in by_target or len(by_target) < free:
                by_target.setdefault(message.target, []).append(message)
        return by_target

    async def _deliver_all(
        self, client: httpx.AsyncClient, target: str, messages: list[OutboxMessage]
    ) -> None:
        try:
            for message in messages:
                await self._deliver(client, message)
        finally:
            self._in_flight.discard(target)

    async def _save_outcomes(self) -> bool:
        """Save the outcomes the store refused before; whether none is left unsaved."""
        metadata, calls = self._service.metadata, self._service.parts.calls
        for key, outcome in list(self._unsaved.items()):
            try:
                if outcome is None:
                    await calls(metadata.delete_webhook, *key)
                else:
                    await calls(metadata.reschedule_webhook, outcome)
            except Exception as exc:
                logger.debug("webhook outcome still not saved: %s", exc)
                return False
            del self._unsaved[key]
        return True

    async def _save(self, message: OutboxMessage, outcome: OutboxMessage | None) -> None:
        """Delete (``outcome`` None) or reschedule the message; kept for later if the store refuses."""
        metadata, calls = self._service.metadata, self._service.parts.calls
        try:
            if outcome is None:
                await calls(metadata.delete_webhook, message.event_id, message.target)
            else:
                await calls(metadata.reschedule_webhook, outcome)
        except Exception as exc:
            logger.warning(
                "webhook %s: the outcome of the attempt is not saved yet: %s",
                message.event_id,
                exc,
                extra={"event": "webhook.unsaved", "event_id": message.event_id},
            )
            self._unsaved[(message.event_id, message.target)] = outcome

    async def _deliver(self, client: httpx.AsyncClient, message: OutboxMessage) -> None:
        error = await self._send(client, message)
        target = redact_url(message.target)
        if error is None:
            await self._save(message, None)
            self.counts.delivered += 1
            logger.info(
                "webhook %s delivered to %s",
                message.event_id,
                target,
                extra={"event": "webhook.delivered", "event_id": message.event_id},
            )
            return
        self.counts.failed += 1
        attempts = message.attempts + 1
        now = self._clock()
        next_at = now + retry_delay_s(attempts, self._retry_initial_s, self._rng)
        if next_at - message.created_at > GIVE_UP_AFTER_S:
            await self._save(message, None)
            self.counts.abandoned += 1
            logger.error(
                "webhook %s to %s given up after %d attempts over a day: %s",
                message.event_id,
                target,
                attempts,
                error,
                extra={"event": "webhook.abandoned", "event_id": message.event_id},
            )
            return
        await self._save(
            message, attrs.evolve(message, attempts=attempts, next_attempt_at=next_at, last_error=error)
        )
        log = logger.warning if attempts == 1 else logger.debug
        log(
            "webhook %s to %s failed (attempt %d, next in %.0f s): %s",
            message.event_id,
            target,
            attempts,
            next_at - now,
            error,
            extra={"event": "webhook.failed", "event_id": message.event_id},
        )

    async def _send(self, client: httpx.AsyncClient, message: OutboxMessage) -> str | None:
        """POST the message once, all of it within ``timeout_s``; None when delivered, else why
        not (with the URL's credentials redacted)."""
        headers = webhook_headers(self._key, message.event_id, int(self._clock()), message.body)
        response: httpx.Response | None = None
        try:
            with anyio.move_on_after(self._timeout_s):
                response = await client.post(message.target, content=message.body, headers=headers)
        except httpx.HTTPError as exc:
            return redact_urls_in(f"{type(exc).__name__}: {exc}", [message.target])
        if response is None:
            return f"no complete answer within {self._timeout_s:g} s"
        if 200 <= response.status_code < 300:
            return None
        return f"HTTP {response.status_code}"
