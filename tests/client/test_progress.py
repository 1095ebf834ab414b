"""The progress line of batchgen.client: its text, the rate and ETA, and how it is drawn."""

from __future__ import annotations

import io
from typing import Any

import pytest

from batchgen.client._progress import (
    BatchProgress,
    Counts,
    ProgressLine,
    RateMeter,
    counts_of,
    format_duration,
    format_progress,
    progress_for,
    server_rate,
)


def batch(status: str = "in_progress", **counts: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "batch_1", "status": status}
    if counts:
        body["request_counts"] = counts
    return body


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_counts_of() -> None:
    assert counts_of(batch(total=10, completed=3, failed=1)) == Counts(10, 3, 1)
    assert counts_of(batch(total=10, completed=3, failed=1)).done == 4  # type: ignore[union-attr]
    assert counts_of(batch(total=10)) == Counts(10, 0, 0)
    assert counts_of(batch()) is None
    assert counts_of(batch(total="10")) is None
    assert counts_of(batch(total=-1)) is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (44.6, "45s"), (60, "1m00s"), (185, "3m05s"), (3600, "1h00m"), (7620, "2h07m"), (-3, "0s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_rate_meter_measures_over_its_window() -> None:
    meter = RateMeter(window=3)
    assert meter.rate() is None
    meter.add(0.0, 0)
    assert meter.rate() is None  # one sample
    meter.add(2.0, 100)
    assert meter.rate() == 50
    meter.add(4.0, 100)
    meter.add(6.0, 400)  # the first sample falls out of the window
    assert meter.rate() == 75


def test_rate_meter_starts_over_when_counts_go_back() -> None:
    meter = RateMeter()
    meter.add(0.0, 100)
    meter.add(1.0, 200)
    meter.add(2.0, 50)
    assert meter.rate() is None


def test_running_batch_shows_counts_eta_and_rate() -> None:
    text = format_progress(batch(total=1000, completed=240, failed=10), rate=50.0)
    assert text == (
        "batch_1 in_progress  25% [#####...............] 250/1000 done, 10 failed, ETA 15s, 50 req/s"
    )


def test_slow_rate_has_a_decimal_and_no_rate_means_no_eta() -> None:
    assert "ETA 3m20s, 2.5 req/s" in format_progress(batch(total=1000, completed=500), rate=2.5)
    assert format_progress(batch(total=10, completed=5)).endswith("5/10 done, 0 failed")
    assert "ETA" not in format_progress(batch(total=10, completed=5), rate=0.0)


def test_ended_batch_shows_the_time_taken() -> None:
    text = format_progress(batch("completed", total=4, completed=3, failed=1), rate=2.0, elapsed=125)
    assert text.endswith("4/4 done, 1 failed, in 2m05s, 2.0 req/s")
    assert "[####################]" in text
    cancelled = format_progress(batch("cancelled", total=4, completed=1), elapsed=3)
    assert "ETA" not in cancelled and "in 3s" in cancelled


def test_batch_without_counts_shows_id_and_status() -> None:
    assert format_progress(batch("validating")) == "batch_1 validating"
    assert format_progress(batch("validating", total=0)) == "batch_1 validating"


def test_long_ids_are_shortened() -> None:
    text = format_progress({"id": "batch_0123456789abcdef0123", "status": "in_progress"})
    assert text == "batch_0123456789.. in_progress"


def test_bar_fits_the_width_and_keeps_its_size() -> None:
    texts = [
        format_progress(batch(total=20000, completed=done), rate=rate, width=100)
        for done, rate in [(5, 1.0), (15000, 1234.0)]
    ]
    assert all(len(text) <= 100 for text in texts)
    assert len({text.index("]") for text in texts}) == 1  # the bar does not move as numbers grow
    narrow = format_progress(batch(total=20000, completed=5), rate=1.0, width=60)
    assert "[" not in narrow and "5/20000 done" in narrow


def test_progress_line_redraws_a_terminal_line() -> None:
    stream = Terminal()
    line = ProgressLine(stream, redraw=True)
    line.show("one")
    line.show("two")
    line.close()
    assert stream.getvalue() == "\rone\x1b[K\rtwo\x1b[K\n"


def test_progress_line_elsewhere_prints_on_change_only() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream, redraw=False)
    line.show("a 1", key=1)
    line.show("a 1 later", key=1)
    line.show("a 2", key=2)
    line.close()
    assert stream.getvalue() == "a 1\na 2\n"


def test_closing_an_unused_line_writes_nothing() -> None:
    stream = Terminal()
    ProgressLine(stream, redraw=True).close()
    assert stream.getvalue() == ""


def test_progress_for_follows_the_stream_unless_told() -> None:
    assert progress_for(None, io.StringIO()) is None
    assert progress_for(False, Terminal()) is None
    assert isinstance(progress_for(None, Terminal()), BatchProgress)
    assert isinstance(progress_for(True, io.StringIO()), BatchProgress)


def test_batch_progress_measures_the_rate_between_polls() -> None:
    now = [0.0]
    stream = io.StringIO()
    progress = BatchProgress(stream, redraw=False, clock=lambda: now[0])
    for second, done in [(1, 0), (3, 100), (5, 200)]:
        now[0] = second
        progress.update(batch(total=400, completed=done))
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[-1].endswith("200/400 done, 0 failed, ETA 4s, 50 req/s")


def test_batch_progress_prefers_the_rate_the_server_measured() -> None:
    stream = io.StringIO()
    progress = BatchProgress(stream, redraw=False, clock=lambda: 0.0)
    progress.update(batch(total=400, completed=100) | {"requests_per_second": 25.0})
    assert stream.getvalue().rstrip().endswith("100/400 done, 0 failed, ETA 12s, 25 req/s")


@pytest.mark.parametrize("value", [None, -1, "fast", True, float("nan")])
def test_a_missing_or_odd_server_rate_is_not_used(value: object) -> None:
    assert server_rate({"requests_per_second": value}) is None
    assert server_rate({}) is None
    assert server_rate({"requests_per_second": 0}) == 0.0
