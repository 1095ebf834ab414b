"""The smoothed rate behind the pool status's requests/s and tokens/s and a batch's pace
(smoothed_rate, telemetry.Throughput): properties over generated noisy inputs."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.smoothed_rate import SmoothedRate
from batchgen.core.telemetry import Throughput

#: Readings of a running total: (seconds since the last reading, growth since it).
readings = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=120.0, allow_nan=False), st.integers(0, 10_000)),
    min_size=1,
    max_size=60,
)


@given(readings, st.floats(min_value=1.0, max_value=300.0))
def test_each_reading_lands_between_the_last_rate_and_the_rate_just_read(
    history: list[tuple[float, int]], tau: float
) -> None:
    """So the rate never overshoots what it is fed: no spike larger than the input's own."""
    meter = SmoothedRate(tau, 0.0)
    now, total = 0.0, 0
    for wait, growth in history:
        before = meter.rate()
        now, total = now + wait, total + growth
        after = meter.update(now, total)
        assert after >= 0
        if wait > 0 and meter.seconds_seen > wait:  # an interval of its own rate, after the first
            own = growth / wait
            low, high = min(before, own), max(before, own)
            assert low * (1 - 1e-9) - 1e-9 <= after <= high * (1 + 1e-9) + 1e-9


@given(
    st.floats(min_value=5.0, max_value=120.0),  # time constant
    st.floats(min_value=0.5, max_value=5_000.0),  # the stream's mean per second
    st.lists(  # (wait as a share of the time constant, the lump's noise), repeated in turn
        st.tuples(st.floats(min_value=0.01, max_value=0.5), st.floats(min_value=0.6, max_value=1.4)),
        min_size=1,
        max_size=30,
    ),
)
def test_a_noisy_steady_stream_gives_a_rate_near_its_mean_whatever_the_noise(
    tau: float, mean: float, pattern: list[tuple[float, float]]
) -> None:
    """Tokens come in uneven lumps (steps of a batch whose rows change) at uneven intervals up to
    half the time constant: once a few time constants have passed, the rate stays within a factor
    of 2 of the stream's mean, and moves by at most a factor of 1.5 between two readings."""
    meter = SmoothedRate(tau, 0.0)
    now, total, last = 0.0, 0.0, None
    for share, noise in itertools.islice(itertools.cycle(pattern), 100_000):
        if now >= 6 * tau:
            break
        wait = share * tau
        now, total = now + wait, total + noise * mean * wait
        rate = meter.update(now, total)
        if now >= 3 * tau:
            assert mean / 2 <= rate <= mean * 2
            if last is not None:
                assert last / 1.5 <= rate <= last * 1.5
            last = rate


@given(
    st.floats(min_value=0.5, max_value=1_000.0),  # steady rate
    st.sampled_from([0.1, 0.5, 1.5, 5.0]),  # seconds between readings
    st.sampled_from([10.0, 30.0, 120.0]),  # time constant
)
def test_a_steady_rate_reads_the_same_however_often_it_is_read(rate: float, every: float, tau: float) -> None:
    meter = SmoothedRate(tau, 0.0)
    now = 0.0
    while now < 2 * tau:
        now += every
        meter.update(now, rate * now)
    assert meter.rate() == pytest.approx(rate, rel=1e-6)


def test_a_young_meter_reports_the_average_since_its_start() -> None:
    meter = SmoothedRate(600.0, 0.0)
    assert meter.update(2.0, 10) == pytest.approx(5.0)
    assert meter.update(4.0, 10) == pytest.approx(2.5, rel=1e-2)  # not dragged towards 0 by its youth


def test_peek_changes_nothing_and_a_lull_lowers_the_rate_by_at_most_its_decay() -> None:
    meter = SmoothedRate(30.0, 0.0)
    for second in range(1, 121):
        meter.update(float(second), 10 * second)
    assert meter.rate() == pytest.approx(10.0)
    later = meter.peek(150.0)
    assert meter.rate() == pytest.approx(10.0)
    assert 10.0 * math.exp(-30 / 30) * 0.9 <= later < 10.0


def test_a_total_that_goes_down_restarts_the_count_without_a_negative_rate() -> None:
    meter = SmoothedRate(30.0, 0.0)
    meter.update(10.0, 1000)
    assert meter.update(11.0, 5) >= 0
    assert meter.update(12.0, 15) > meter.peek(12.0, 5) * 0  # counts on from the new total
    with pytest.raises(ValueError):
        SmoothedRate(0.0, 0.0)


def test_throughput_reads_both_rates_from_the_running_totals() -> None:
    now = [0.0]
    meter = Throughput(time_constant_s=30.0, clock=lambda: now[0])
    for second in range(1, 61):
        now[0] = float(second)
        requests, tokens = meter.read(2 * second, 300 * second)
    assert requests == pytest.approx(2.0) and tokens == pytest.approx(300.0)
    assert meter.time_constant_s == 30.0
