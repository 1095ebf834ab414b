"""The pace of a batch and its estimated completion (batch_progress): properties over generated
histories, with a hand-driven clock."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.batches.progress import MIN_SPAN_S, UNKNOWN, ProgressWindow, estimate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


#: A history: (seconds since the last sample, requests finished in that time).
steps = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=30.0, allow_nan=False), st.integers(0, 500)),
    max_size=40,
)


def replay(history: list[tuple[float, int]], window_s: float = 20.0) -> tuple[ProgressWindow, Clock, int]:
    clock = Clock()
    window = ProgressWindow(window_s, clock=clock)
    finished = 0
    for wait, done in history:
        clock.now += wait
        finished += done
        window.record(finished)
    return window, clock, finished


@given(steps, st.integers(0, 10_000), st.floats(min_value=0, max_value=100, allow_nan=False))
def test_the_pace_and_the_time_left_are_never_negative(
    history: list[tuple[float, int]], extra: int, later: float
) -> None:
    window, clock, finished = replay(history)
    clock.now += later
    found = window.estimate(finished, finished + extra, wall_now=0.0)
    assert found.requests_per_second is None or found.requests_per_second >= 0
    assert found.seconds_remaining is None or found.seconds_remaining >= 0
    assert found.completion_at is None or found.completion_at >= 0
    # an end time exactly when there is a time left
    assert (found.completion_at is None) == (found.seconds_remaining is None)


@given(steps, st.integers(0, 10_000))
def test_no_progress_means_no_estimate(history: list[tuple[float, int]], total: int) -> None:
    """With nothing finished, there is a pace of zero (or none yet) but never a time left."""
    window, _, _ = replay([(wait, 0) for wait, _ in history])
    found = window.estimate(0, total)
    assert found.requests_per_second in (None, 0.0)
    assert found.seconds_remaining is None


@given(steps)
def test_nothing_left_means_no_time_left(history: list[tuple[float, int]]) -> None:
    window, _, finished = replay(history)
    assert window.estimate(finished, finished).seconds_remaining is None


@given(steps, st.integers(0, 5_000), st.integers(0, 5_000))
def test_more_left_never_means_less_time(history: list[tuple[float, int]], left: int, more: int) -> None:
    window, _, finished = replay(history)
    fewer = window.estimate(finished, finished + left).seconds_remaining
    most = window.estimate(finished, finished + left + more).seconds_remaining
    if fewer is not None and most is not None:
        assert most >= fewer
    if fewer is not None and more >= 0:
        assert most is not None  # a known pace predicts any amount left


@given(
    st.integers(1, 200),  # requests per second, steady
    st.integers(2, 60),  # seconds it ran
    st.integers(1, 100_000),  # requests left
)
def test_a_steady_pace_is_measured_and_predicts_the_rest(rate: int, seconds: int, left: int) -> None:
    clock = Clock()
    start = clock.now
    window = ProgressWindow(20.0, clock=clock)
    finished = 0
    for _ in range(seconds * 4):  # four samples a second
        clock.now += 0.25
        finished = math.floor(rate * (clock.now - start))
        window.record(finished)
    found = window.estimate(finished, finished + left)
    measured = found.requests_per_second
    assert measured == pytest.approx(rate, rel=0.1)
    assert measured is not None and found.seconds_remaining == pytest.approx(left / measured)


def test_a_stalled_batch_has_its_pace_fall_and_its_time_left_grow_as_the_stall_lengthens() -> None:
    window, clock, finished = replay([(1.0, 10)] * 10, window_s=5.0)
    assert (window.estimate(finished, 500).requests_per_second or 0) > 5
    paces, times_left = [], []
    for _ in range(6):
        clock.now += 5.0  # nothing finishes: each time constant more, the pace falls below 1/e of it
        found = window.estimate(finished, 500)
        assert found.requests_per_second is not None and found.seconds_remaining is not None
        paces.append(found.requests_per_second)
        times_left.append(found.seconds_remaining)
    assert all(later < earlier / 2 for earlier, later in itertools.pairwise(paces))
    assert times_left == sorted(times_left) and paces[-1] < paces[0] / 30


#: A batch whose requests end in bursts around a steady pace: (the gap to the next burst, its size)
#: as shares of the nominal gap (up to a minute: a transformers batch of long answers whose rows
#: end together) and size, each within 25 %, repeated in turn.
burst_pattern = st.lists(
    st.tuples(st.floats(min_value=0.75, max_value=1.25), st.floats(min_value=0.75, max_value=1.25)),
    min_size=1,
    max_size=30,
)


@given(st.floats(min_value=1.0, max_value=60.0), st.integers(4, 64), burst_pattern)
def test_requests_ending_in_bursts_give_a_steady_pace_and_time_left(
    gap: float, size: int, pattern: list[tuple[float, float]]
) -> None:
    """Polled every second, as a dashboard does: once the batch has run for five minutes, the
    pace stays within a factor of 3 of the pattern's own (bursts of about ``size`` every ``gap`` seconds),
    and the time left within any one minute never swings by more than a factor of 2.5 (it swung
    from 941 s to 16,890 s to 555 s: a 20 s window saw bursts a minute apart as 0, then a spike)."""
    # The pace the pattern really has: its sizes are whole requests and its gaps vary in turn.
    nominal = sum(max(1, round(size * share)) for _, share in pattern) / sum(
        gap * share for share, _ in pattern
    )
    clock = Clock()
    start = clock.now
    window = ProgressWindow(clock=clock)
    finished, total = 0, 10**9
    seen: list[tuple[float, float, float]] = []  # (time, pace, time left)
    for gap_share, size_share in itertools.cycle(pattern):
        if clock.now - start > 480.0:
            break
        due = clock.now + gap * gap_share
        while clock.now + 1.0 < due:  # a poll every second between bursts
            clock.now += 1.0
            found = window.estimate(finished, total)
            if clock.now - start >= 300.0:
                assert found.requests_per_second is not None and found.seconds_remaining is not None
                seen.append((clock.now, found.requests_per_second, found.seconds_remaining))
        clock.now = due
        finished += max(1, round(size * size_share))
        window.record(finished)
    for moment, pace, _ in seen:
        assert nominal / 3 <= pace <= nominal * 3, (moment - start, pace, nominal)
    for index, (moment, _, _) in enumerate(seen):
        within = [left for when, _, left in seen[index:] if when - moment <= 60.0]
        assert max(within) <= 2.5 * min(within), (moment - start, min(within), max(within))


def test_less_than_a_second_of_history_gives_no_pace() -> None:
    window, clock, finished = replay([(0.2, 5), (0.3, 5)])
    assert window.estimate(finished, 100) == UNKNOWN
    clock.now += MIN_SPAN_S
    assert window.estimate(finished, 100).requests_per_second is not None


def test_restart_forgets_what_was_done_before() -> None:
    """Counts rebuilt after a restart are not finished at this pace."""
    window, clock, _ = replay([])
    window.restart(900)
    clock.now += 2
    window.record(910)
    found = window.estimate(910, 1000, wall_now=50.0)
    assert found.requests_per_second == pytest.approx(5.0)
    assert found.seconds_remaining == pytest.approx(18.0)
    assert found.completion_at == math.ceil(50.0 + 18.0)


def test_the_window_must_be_at_least_a_second() -> None:
    with pytest.raises(ValueError):
        ProgressWindow(0.5)


def test_an_unknown_pace_predicts_nothing() -> None:
    assert estimate(None, 5) == UNKNOWN
    assert estimate(0.0, 5).seconds_remaining is None
