"""The at-risk marker of the progress lines (`batchgen watch`, `submit`, `wait_for_batch`)."""

from __future__ import annotations

import io
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from batchgen.client._progress import AT_RISK_MARKER, format_progress
from batchgen.client._watch import BatchBoard


def _batch(status: str, done: int, total: int, at_risk: object) -> dict[str, Any]:
    return {
        "id": "batch_0123456789abcdef",
        "status": status,
        "request_counts": {"total": total, "completed": done, "failed": 0},
        "at_risk": at_risk,
    }


@given(
    status=st.sampled_from(["validating", "in_progress", "completed", "failed", "cancelled"]),
    total=st.integers(1, 10**6),
    share=st.floats(0, 1),
    at_risk=st.sampled_from([True, False, None, "true", 1]),
    width=st.one_of(st.none(), st.integers(20, 200)),
)
def test_the_marker_shows_exactly_while_a_running_batch_is_at_risk(
    status: str, total: int, share: float, at_risk: object, width: int | None
) -> None:
    done = min(total, int(total * share))
    line = format_progress(_batch(status, done, total, at_risk), rate=2.0, width=width)
    running = status in ("validating", "in_progress") and done < total
    assert (AT_RISK_MARKER in line) is (running and at_risk is True)


def test_watch_prints_a_line_again_when_a_batch_becomes_at_risk() -> None:
    stream = io.StringIO()
    board = BatchBoard(stream, redraw=False)
    board.update([_batch("in_progress", 5, 100, False)])
    board.update([_batch("in_progress", 5, 100, True)])
    board.update([_batch("in_progress", 5, 100, True)])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and AT_RISK_MARKER not in lines[0] and AT_RISK_MARKER in lines[1]
