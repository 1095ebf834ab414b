"""A batch's progress as one line of text, from its `request_counts`, drawn on stderr.

    batch_4f1c2a97d9.. in_progress  35% [#######.............] 7000/20000 done, 12 failed, ETA 7s, 1,840 req/s

No dependency: on a terminal the line is redrawn in place (carriage return, then erase to the end
of the line) and cut to the terminal's width; on anything else, when progress was asked for
explicitly, a new line is printed each time the status or the counts change.

`format_progress` and `RateMeter` are pure; `BatchProgress` is what `wait_for_batch` feeds. The rate
shown is the server's `requests_per_second` when the batch object has one (BatchGen servers send
it), else measured between polls.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from batchgen.client._cache_savings import cache_savings
from batchgen.client._requests import TERMINAL_STATUSES

__all__ = [
    "AT_RISK_MARKER",
    "BatchProgress",
    "Counts",
    "RateMeter",
    "counts_of",
    "format_duration",
    "format_progress",
    "is_at_risk",
    "progress_for",
    "server_rate",
]

BAR_WIDTH = 20
MIN_BAR_WIDTH = 8
MAX_BAR_WIDTH = 30
ID_WIDTH = 18
ERASE_TO_END_OF_LINE = "\x1b[K"
#: Shown at the end of a running batch's line while the server marks it `at_risk`.
AT_RISK_MARKER = "AT RISK: ends after it expires"


@dataclass(frozen=True, slots=True)
class Counts:
    """A batch's `request_counts`: `done` is completed plus failed."""

    total: int
    completed: int
    failed: int

    @property
    def done(self) -> int:
        return self.completed + self.failed


def counts_of(batch: Mapping[str, Any]) -> Counts | None:
    """The batch's request counts, or None when it has none (yet) or they are malformed."""
    counts = batch.get("request_counts")
    if not isinstance(counts, Mapping):
        return None
    values = [counts.get(key, 0) for key in ("total", "completed", "failed")]
    if not all(isinstance(value, int) and value >= 0 for value in values):
        return None
    return Counts(*values)


def is_at_risk(batch: Mapping[str, Any]) -> bool:
    """Whether the server says the batch, at its recent pace, ends after its `expires_at`."""
    return batch.get("at_risk") is True


def server_rate(batch: Mapping[str, Any]) -> float | None:
    """The batch's own `requests_per_second`, measured by a server that sends it, else None."""
    rate = batch.get("requests_per_second")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate >= 0:
        return None
    return float(rate)


class RateMeter:
    """Requests finished per second, measured over the last `window` polls.

    A window rather than the whole wait, so that time spent queued behind other batches does not
    drag the rate (and so the ETA) down once the batch is running.
    """

    def __init__(self, window: int = 10) -> None:
        self._samples: deque[tuple[float, int]] = deque(maxlen=window)

    def add(self, now: float, done: int) -> None:
        if self._samples and done < self._samples[-1][1]:  # counts went back (a restart): start over
            self._samples.clear()
        self._samples.append((now, done))

    def rate(self) -> float | None:
        """Requests per second, or None until two polls some time apart have been seen."""
        if len(self._samples) < 2:
            return None
        (start, first), (end, last) = self._samples[0], self._samples[-1]
        if end <= start:
            return None
        return (last - first) / (end - start)


def format_duration(seconds: float) -> str:
    """`45s`, `3m05s`, `2h07m`: short, and precise enough for an estimate."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_progress(
    batch: Mapping[str, Any],
    *,
    rate: float | None = None,
    elapsed: float | None = None,
    width: int | None = None,
) -> str:
    """One line: id, status, percent, a bar, done/total and failed, ETA (or time taken), rate.

    `done` counts completed and failed requests. The ETA is shown while the batch runs and the
    rate is known and positive; once it has ended, `elapsed` (seconds waited) instead. The bar
    takes what `width` leaves (none below a few characters); without `width` it is 20 wide.
    """
    head = f"{_short_id(batch.get('id'))} {batch.get('status', '?')!s:<11}"
    counts = counts_of(batch)
    if counts is None or counts.total <= 0:
        return head.rstrip()
    share = min(counts.done / counts.total, 1.0)
    stats = [f"{counts.done}/{counts.total} done", f"{counts.failed} failed"]
    savings = cache_savings(batch)
    if savings is not None and savings.requests:
        stats.append(f"{savings.requests} from cache")
    ended = counts.done >= counts.total or batch.get("status") in TERMINAL_STATUSES
    if ended:
        if elapsed is not None:
            stats.append(f"in {format_duration(elapsed)}")
    elif rate:
        stats.append(f"ETA {format_duration((counts.total - counts.done) / rate)}")
    if rate is not None:
        stats.append(f"{rate:,.1f} req/s" if rate < 10 else f"{rate:,.0f} req/s")
    risk = not ended and is_at_risk(batch)
    if risk:
        stats.append(AT_RISK_MARKER)
    before, after = f"{head} {share:4.0%} ", " " + ", ".join(stats)
    # Sized against the widest the stats get for this total, so the bar keeps its width.
    widest = len(f" {counts.total}/{counts.total} done, {counts.total} failed, ETA 00m00s, 9,999 req/s")
    if savings is not None and savings.requests:
        widest += len(f", {counts.total} from cache")
    widest += len(f", {AT_RISK_MARKER}") if risk else 0
    bar_width = BAR_WIDTH if width is None else min(width - len(before) - widest - 2, MAX_BAR_WIDTH)
    if bar_width < MIN_BAR_WIDTH:
        return before + after.lstrip()
    filled = int(share * bar_width)
    return f"{before}[{'#' * filled}{'.' * (bar_width - filled)}]{after}"


def _short_id(batch_id: object) -> str:
    text = str(batch_id) if batch_id is not None else "?"
    return text if len(text) <= ID_WIDTH else text[: ID_WIDTH - 2] + ".."


class ProgressLine:
    """Shows successive status lines on a text stream: redrawn in place, or one per change."""

    def __init__(self, stream: TextIO, *, redraw: bool) -> None:
        self.stream = stream
        self.redraw = redraw
        self._last: str | None = None
        self._key: object = None

    @property
    def width(self) -> int:
        """Columns a redrawn line may use: one less than the terminal's, so it never wraps."""
        return shutil.get_terminal_size(fallback=(100, 24)).columns - 1

    def show(self, text: str, *, key: object = None) -> None:
        """Draw `text`. Without redrawing, a line is printed only when `key` changes."""
        if self.redraw:
            self.stream.write("\r" + text[: max(self.width, 10)] + ERASE_TO_END_OF_LINE)
        elif self._last is None or key != self._key:
            self.stream.write(text + "\n")
        else:
            return
        self.stream.flush()
        self._last, self._key = text, key

    def close(self) -> None:
        """End a redrawn line, so that what is printed next starts on a line of its own."""
        if self.redraw and self._last is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._last = None


class BatchProgress:
    """The progress display of one wait: feed it each polled batch, close it when done."""

    def __init__(self, stream: TextIO, *, redraw: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self._line = ProgressLine(stream, redraw=redraw)
        self._meter = RateMeter()
        self._clock = clock
        self._started = clock()

    def update(self, batch: Mapping[str, Any]) -> None:
        now = self._clock()
        counts = counts_of(batch)
        if counts is not None:
            self._meter.add(now, counts.done)
        width = self._line.width if self._line.redraw else None
        rate = server_rate(batch)
        if rate is None:
            rate = self._meter.rate()
        text = format_progress(batch, rate=rate, elapsed=now - self._started, width=width)
        self._line.show(text, key=(batch.get("status"), counts, is_at_risk(batch)))

    def close(self) -> None:
        self._line.close()


def progress_for(
    progress: bool | None, stream: TextIO | None = None, *, clock: Callable[[], float] = time.monotonic
) -> BatchProgress | None:
    """The display `progress` asks for, on `stream` (default: stderr), or None for none.

    None means: only when the stream is a terminal. True shows it anyway (a line per change when
    the stream is not a terminal); False never.
    """
    stream = sys.stderr if stream is None else stream
    tty = _isatty(stream)
    if not (tty if progress is None else progress):
        return None
    return BatchProgress(stream, redraw=tty, clock=clock)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
