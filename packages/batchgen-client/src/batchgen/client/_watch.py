"""`batchgen watch`: the progress of several batches, one line each, until every one has ended.

    batch_4f1c2a97d9.. in_progress  35% [#######.............] 7000/20000 done, 12 failed, ETA 7s, 18.4 req/s
    batch_9a0b11c2e4.. completed   100% [####################] 500/500 done, 0 failed, in 41s

Each line is `format_progress`'s. The rate is the server's `requests_per_second` when the batch
object has one (measured over the server's recent window), else measured here between polls
(`RateMeter`). On a terminal the block of lines is redrawn in place (unless it is taller than the
terminal); on anything else a batch's line is printed again only when its status or counts
change, so a log stays short.

`BatchBoard` draws (`board_for` picks how, for a stream); `watch_batches` polls (with an injectable sleep and clock for tests) and
`active_batch_ids` finds the batches a bare `batchgen watch` follows.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from batchgen.client._client import BatchGenHttpClient
from batchgen.client._progress import (
    ERASE_TO_END_OF_LINE,
    RateMeter,
    _isatty,
    counts_of,
    format_progress,
    is_at_risk,
    server_rate,
)
from batchgen.client._requests import TERMINAL_STATUSES, JSONObject

__all__ = ["BatchBoard", "active_batch_ids", "board_for", "watch_batches"]

#: The most batches a page of `list_batches` holds (the server's limit).
PAGE_LIMIT = 100
_END_FIELDS = ("completed_at", "failed_at", "cancelled_at", "expired_at")


def active_batch_ids(client: BatchGenHttpClient) -> list[str]:
    """The ids of every batch that has not ended, newest first (all pages of the listing)."""
    found: list[str] = []
    after: str | None = None
    while True:
        page = client.list_batches(after=after, limit=PAGE_LIMIT)
        batches = [batch for batch in page.get("data", []) if isinstance(batch, Mapping)]
        found += [str(b["id"]) for b in batches if b.get("status") not in TERMINAL_STATUSES and "id" in b]
        if not page.get("has_more") or not batches:
            return found
        after = str(batches[-1]["id"])


def _duration(batch: Mapping[str, Any]) -> float | None:
    """Seconds from the batch's creation to its end, from the server's timestamps."""
    created = batch.get("created_at")
    ended = [batch.get(field) for field in _END_FIELDS]
    last = max((value for value in ended if isinstance(value, int)), default=None)
    if not isinstance(created, int) or last is None:
        return None
    return float(max(0, last - created))


class BatchBoard:
    """The lines of the batches watched, in the order given; feed it each round of polls."""

    def __init__(self, stream: TextIO, *, redraw: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.redraw = redraw
        self._clock = clock
        self._meters: dict[str, RateMeter] = {}
        self._shown: dict[str, object] = {}  # what each batch's last printed line showed
        self._drawn = 0  # lines of the block on the terminal

    def update(self, batches: Sequence[Mapping[str, Any]]) -> None:
        if self.redraw and not self._drawn and len(batches) >= self._height():
            self.redraw = False  # a block taller than the terminal cannot be redrawn in place
        now = self._clock()
        lines: list[tuple[str, str, object]] = []
        for batch in batches:
            batch_id = str(batch.get("id"))
            counts = counts_of(batch)
            meter = self._meters.setdefault(batch_id, RateMeter())
            if counts is not None:
                meter.add(now, counts.done)
            rate = server_rate(batch)
            if rate is None:
                rate = meter.rate()
            width = self._width() if self.redraw else None
            text = format_progress(batch, rate=rate, elapsed=_duration(batch), width=width)
            lines.append((batch_id, text, (batch.get("status"), counts, is_at_risk(batch))))
        if self.redraw:
            self._draw_block([text for _, text, _ in lines])
        else:
            for batch_id, text, key in lines:
                if self._shown.get(batch_id, self) != key:
                    self.stream.write(text + "\n")
                    self._shown[batch_id] = key
        self.stream.flush()

    def _draw_block(self, texts: list[str]) -> None:
        if self._drawn:
            self.stream.write(f"\x1b[{self._drawn}A")  # back up to the block's first line
        width = max(self._width(), 10)
        for text in texts:
            self.stream.write("\r" + text[:width] + ERASE_TO_END_OF_LINE + "\n")
        self._drawn = len(texts)

    @staticmethod
    def _width() -> int:
        return shutil.get_terminal_size(fallback=(100, 24)).columns - 1

    @staticmethod
    def _height() -> int:
        return shutil.get_terminal_size(fallback=(100, 24)).lines


def board_for(stream: TextIO) -> BatchBoard:
    """Lines redrawn in place on a terminal, else printed as they change."""
    return BatchBoard(stream, redraw=_isatty(stream))


def watch_batches(
    client: BatchGenHttpClient,
    batch_ids: Sequence[str],
    board: BatchBoard,
    *,
    poll_interval: float = 1.0,
    sleep: Callable[[float], object] = time.sleep,
) -> list[JSONObject]:
    """Poll the batches and draw them until every one has ended; return their last objects."""
    ids = list(dict.fromkeys(batch_ids))
    while True:
        batches = [client.get_batch(batch_id) for batch_id in ids]
        board.update(batches)
        if all(batch.get("status") in TERMINAL_STATUSES for batch in batches):
            return batches
        sleep(poll_interval)
