"""Webhook events waiting to be delivered, made in the same write as a batch's terminal status.

When a batch ends (completed, failed, expired, cancelled) the tracker asks ``WebhookTargets`` for
its messages: one event in OpenAI's shape, ``{"id": "evt_…", "object": "event", "type":
"batch.completed", "created_at": …, "data": {"id": "batch_…"}}``, for each URL it goes to. The
metadata store saves them with the status in one transaction (its outbox), so an event is never
lost between the batch's end and its delivery, whatever stops the process. A deliverer (the
server's ``webhooks`` module) sends what is due, at least once, with the same event id and body on
every attempt so a receiver can drop repeats, and reschedules failures with ``retry_delay_s``
until ``GIVE_UP_AFTER_S`` has passed since the event was made.

The URLs are the server's (``--webhook-url``) unless the server allows a batch to name its own,
in its metadata under ``webhook_url``; that value is checked when the batch is created. A URL may
carry credentials (``https://user:password@host/``, ``?token=…``): wherever one is shown (the
errors here, the reprs, the deliverer's logs) it is shown redacted (``url_redaction``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

import attrs
import msgspec

from batchgen.core.errors import InvalidRequest
from batchgen.core.ids import new_object_id
from batchgen.core.models import Batch, BatchStatus
from batchgen.core.url_redaction import redact_url

#: The event type of each terminal status.
EVENT_TYPES: dict[BatchStatus, str] = {
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.EXPIRED: "batch.expired",
    BatchStatus.CANCELLED: "batch.cancelled",
}
#: The metadata key a batch names its own webhook URL under (when the server allows it).
METADATA_URL_KEY = "webhook_url"
#: Undelivered events are retried for a day after they were made, then dropped with an error log.
GIVE_UP_AFTER_S = 24 * 3600
#: The longest wait between two attempts.
MAX_RETRY_DELAY_S = 3600.0


@attrs.frozen
class OutboxMessage:
    """One event for one URL, and where its delivery stands."""

    event_id: str
    target: str = attrs.field(repr=redact_url)
    body: bytes
    created_at: int
    attempts: int = 0
    next_attempt_at: float = 0.0
    last_error: str | None = None


def check_webhook_url(url: object, param: str = "webhook_url") -> str:
    """``url`` if it is an absolute http(s) URL with a host; InvalidRequest (naming ``param``) if not."""
    if not isinstance(url, str) or len(url) > 2048:
        raise InvalidRequest(f"{param} must be an http(s) URL of at most 2048 characters", param=param)
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed IPv6 bracket
        raise InvalidRequest(f"{param} is not a URL: {redact_url(url)!r}", param=param) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise InvalidRequest(
            f"{param} must be an http(s) URL such as https://example.com/hook, got {redact_url(url)!r}",
            param=param,
        )
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise InvalidRequest(f"{param} has a malformed port: {redact_url(url)!r}", param=param) from None
    return url


def event_body(event_id: str, event_type: str, batch_id: str, created_at: int) -> bytes:
    return msgspec.json.encode(
        {
            "id": event_id,
            "object": "event",
            "type": event_type,
            "created_at": created_at,
            "data": {"id": batch_id},
        }
    )


def retry_delay_s(attempts: int, initial_s: float, rng: random.Random | None = None) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones: ``initial_s`` doubling per
    attempt up to ``MAX_RETRY_DELAY_S``, times a random factor in [0.5, 1.5) so that receivers
    coming back are not hit by every sender at once."""
    base = min(MAX_RETRY_DELAY_S, initial_s * 2 ** max(0, attempts - 1))
    return base * (rng or random).uniform(0.5, 1.5)


def _as_tuple(urls: Iterable[str]) -> tuple[str, ...]:
    return tuple(urls)


@attrs.frozen
class WebhookTargets:
    """Where a batch's events go: the server's URLs, or the batch's own when ``allow_batch_url``."""

    urls: tuple[str, ...] = attrs.field(
        default=(), converter=_as_tuple, repr=lambda urls: repr(tuple(map(redact_url, urls)))
    )
    allow_batch_url: bool = False

    def __attrs_post_init__(self) -> None:
        for url in self.urls:
            check_webhook_url(url, "--webhook-url")

    def check_metadata(self, metadata: Mapping[str, str] | None) -> None:
        """Refuse a batch whose ``webhook_url`` metadata is not a usable URL (when it is honoured)."""
        if self.allow_batch_url and metadata and METADATA_URL_KEY in metadata:
            check_webhook_url(metadata[METADATA_URL_KEY], f"metadata.{METADATA_URL_KEY}")

    def for_batch(self, batch: Batch) -> tuple[str, ...]:
        if self.allow_batch_url and batch.metadata and batch.metadata.get(METADATA_URL_KEY):
            return (batch.metadata[METADATA_URL_KEY],)
        return self.urls

    def messages(self, batch: Batch, now: int, *, event_id: str | None = None) -> Sequence[OutboxMessage]:
        """The messages of ``batch``'s terminal event (none for another status, or with no URL);
        ``event_id`` names the event (by default a fresh id): replicas ending one shared batch
        give the same, so the outbox keeps one message per target."""
        event_type = EVENT_TYPES.get(batch.status)
        targets = self.for_batch(batch)
        if event_type is None or not targets:
            return ()
        event_id = event_id or new_object_id("evt_")
        body = event_body(event_id, event_type, batch.id, now)
        return tuple(
            OutboxMessage(event_id, target, body, now, next_attempt_at=float(now)) for target in targets
        )
