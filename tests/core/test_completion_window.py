"""A batch's completion window is never cut short by whole-second API times.

API times are whole seconds; a batch's window counts from the exact moment it was created. The
deadline arithmetic (``clock.deadline``) lands at or after the exact end of any span from any
instant, and less than a second after it. Then the embedded service on a held clock: for drawn
windows and creation instants (fractions of a second included), a batch created then says when
its window ends (``expires_at``, at or after the exact end), is not ended by the expiry job at any
moment before the exact end, and is ended (``failed``, timed out) by it once a second more has
passed, its ``failed_at`` not before its ``expires_at``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from fractions import Fraction

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batchgen.core import BatchService, ServiceSettings, clock
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.batches.options import MAX_COMPLETION_WINDOW_S, parse_completion_window
from batchgen.core.models import BatchStatus
from tests.examples import examples
from tests.helpers import chat_line, jsonl

CHAT = "/v1/chat/completions"
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}

#: Completion windows as a create call gives them, up to the longest allowed.
windows = st.sampled_from(sorted(_UNIT_S)).flatmap(
    lambda unit: st.integers(1, min(1000, MAX_COMPLETION_WINDOW_S // _UNIT_S[unit])).map(
        lambda n: f"{n}{unit}"
    )
)
#: Moments (seconds since the epoch), often just after or just before a whole second.
instants = st.builds(
    lambda whole, fraction: whole + fraction,
    st.integers(1_600_000_000, 2_400_000_000),
    st.sampled_from([0.0, 1e-6, 0.25, 0.5, 0.999999]) | st.floats(0, 1, exclude_max=True),
)


@settings(max_examples=examples(500))
@given(start=instants, span_s=st.integers(0, MAX_COMPLETION_WINDOW_S))
def test_a_deadline_never_comes_before_its_whole_span_and_at_most_a_second_after(
    start: float, span_s: int
) -> None:
    end = Fraction(start) + span_s  # exact: the float's own value plus the span
    assert end <= clock.deadline(start, span_s) < end + 1


class _HeldClock:
    """Stands in for the ``time`` module of ``batchgen.core.clock``: the time is what a test sets."""

    def __init__(self, at: float) -> None:
        self.at = at

    def time(self) -> float:
        return self.at


@pytest.fixture(scope="module")
def held(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BlockingPortal, BatchService, _HeldClock]]:
    """An embedded service whose clock is held (its requests take an hour: its batches keep
    running until their windows end)."""
    held_clock = _HeldClock(1_700_000_000.0)
    settings = ServiceSettings(storage_path=tmp_path_factory.mktemp("held"), maintenance_interval_s=3600)
    service = BatchService(settings, SimulatedBackend(latency_s=3600))
    with pytest.MonkeyPatch.context() as patch, start_blocking_portal() as portal:
        patch.setattr(clock, "time", held_clock)
        with portal.wrap_async_context_manager(service):
            yield portal, service, held_clock


@settings(max_examples=examples(60), deadline=None)
@given(window=windows, created=instants, data=st.data())
def test_a_batch_ends_once_its_whole_window_has_passed_and_never_before(
    held: tuple[BlockingPortal, BatchService, _HeldClock], window: str, created: float, data: st.DataObject
) -> None:
    portal, service, held_clock = held
    end = Fraction(created) + parse_completion_window(window)
    held_clock.at = created
    file = portal.call(functools.partial(service.create_file, jsonl(chat_line("only"))))
    batch = portal.call(functools.partial(service.create_batch, file.id, CHAT, completion_window=window))
    assert batch.created_at == math.floor(created)
    assert end <= batch.expires_at < end + 1

    before = data.draw(st.floats(created, float(end)), label="a moment before its window ends")
    assume(Fraction(before) < end)
    held_clock.at = before
    portal.call(service.expire_due)
    assert not portal.call(service.get_batch, batch.id).status.is_terminal

    held_clock.at = float(end + 1) + data.draw(st.floats(0, 3600), label="seconds later still")
    portal.call(service.expire_due)
    ended = portal.call(service.get_batch, batch.id)
    assert ended.status is BatchStatus.FAILED and ended.error is not None
    assert (
        "timed out" in ended.error.message and f"({parse_completion_window(window)} s)" in ended.error.message
    )
    assert ended.failed_at is not None and ended.failed_at >= ended.expires_at
