"""Which replicas still report (``execution.replica_work.fleet_status``), on a held clock: a
replica whose last report is older than two report intervals is listed as not reporting, and not
healthy, in ``/v1/pool/status`` and on the dashboard (one killed with SIGKILL stays listed,
silent, until it drops out after three leases)."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from batchgen.core.execution.replica_work import MISSED_REPORTS, REPORT_EVERY_S, fleet_status

LIMIT_S = MISSED_REPORTS * REPORT_EVERY_S
ages = st.floats(min_value=0, max_value=600, allow_nan=False)


def _one(seen_s_ago: float, since_read: float, healthy: bool = True) -> dict[str, Any]:
    report = {"id": "b", "healthy": healthy, "problems": [], "seen_s_ago": seen_s_ago}
    read_at = 1000.0
    (listed,) = fleet_status([report], read_at=read_at, now=read_at + since_read)
    return listed


def test_a_replica_just_heard_from_is_reporting_and_keeps_its_own_health() -> None:
    listed = _one(0.3, 0.5)
    assert (listed["reporting"], listed["healthy"], listed["seen_s_ago"]) == (True, True, 0.8)
    assert _one(0.3, 0.5, healthy=False)["healthy"] is False


def test_a_replica_silent_for_two_reports_is_not_reporting_nor_healthy() -> None:
    listed = _one(LIMIT_S + 0.1, 0.0)
    assert listed["reporting"] is False and listed["healthy"] is False


@given(age=ages, since_read=ages, healthy=st.booleans())
@example(age=0.025, since_read=0.025, healthy=True)  # a sum on a midpoint: 1000.025 - 1000 < 0.025
def test_reporting_means_neither_the_report_nor_the_reading_is_two_intervals_old(
    age: float, since_read: float, healthy: bool
) -> None:
    listed = _one(age, since_read, healthy)
    assert listed["reporting"] is (age <= LIMIT_S and since_read <= LIMIT_S)
    assert listed["healthy"] is (listed["reporting"] and healthy)
    # its age now, not when read, to a tenth of a second (the clock's float sum may land either
    # side of a rounding midpoint, so the nearest tenth is checked, not one rounding of it)
    assert listed["seen_s_ago"] == round(listed["seen_s_ago"], 1)
    assert abs(listed["seen_s_ago"] - (age + since_read)) <= 0.05 + 1e-9


@given(age=ages, since_read=ages, later=ages)
def test_once_silent_a_replica_stays_silent_as_the_clock_runs_on(
    age: float, since_read: float, later: float
) -> None:
    """With no new reading, a replica never comes back: only a fresh report does that."""
    before, after = _one(age, since_read), _one(age, since_read + later)
    assert after["seen_s_ago"] >= before["seen_s_ago"]
    if not before["reporting"]:
        assert not after["reporting"]


@given(st.lists(st.tuples(ages, st.booleans()), max_size=8), ages)
def test_every_replica_read_is_listed_in_its_order_with_its_own_fields(
    reports: list[tuple[float, bool]], since_read: float
) -> None:
    read = [
        {"id": f"r{i}", "healthy": ok, "shards_held": i, "seen_s_ago": age}
        for i, (age, ok) in enumerate(reports)
    ]
    listed = fleet_status(read, read_at=5.0, now=5.0 + since_read)
    assert [(r["id"], r["shards_held"]) for r in listed] == [(r["id"], r["shards_held"]) for r in read]
    assert all(r["seen_s_ago"] == age for r, (age, _) in zip(read, reports, strict=True))  # not changed
