"""The batch state machine, tested exhaustively: every status, every target, every path.

Properties:
- ``advance`` allows exactly the moves in ``ALLOWED`` and refuses every other one, changing nothing;
- a terminal status has no way out, so a status a client has seen as final never changes;
- each status's timestamp is set when the batch first enters it and never moves afterwards;
- ``error`` comes with ``failed`` and only with it;
- every status can be reached from ``validating``, and every walk ends in a terminal status.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.batches.lifecycle import ALLOWED, TIMESTAMP_FIELD, IllegalTransition, advance, can_advance
from batchgen.core.models import Batch, BatchErrorInfo, BatchStatus

TERMINAL = {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
ERROR = BatchErrorInfo("batch_failed", "because")


def _new_batch() -> Batch:
    return Batch(
        id="batch_x",
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        created_at=100,
        expires_at=100 + 86400,
        model="m",
    )


def _at(status: BatchStatus) -> Batch:
    return attrs.evolve(_new_batch(), status=status)


def _error_for(target: BatchStatus) -> BatchErrorInfo | None:
    return ERROR if target is BatchStatus.FAILED else None


@pytest.mark.parametrize(
    ("source", "target"), list(itertools.product(BatchStatus, BatchStatus)), ids=lambda s: s.value
)
def test_every_pair_is_allowed_exactly_when_the_table_says(source: BatchStatus, target: BatchStatus) -> None:
    batch = _at(source)
    if target in ALLOWED[source]:
        moved = advance(batch, target, now=200, error=_error_for(target))
        assert moved.status is target
        assert can_advance(source, target)
    else:
        with pytest.raises(IllegalTransition) as raised:
            advance(batch, target, now=200, error=_error_for(target))
        assert (raised.value.source, raised.value.target) == (source, target)
        assert batch.status is source  # advance is pure: the refused batch is unchanged


def test_terminal_statuses_are_final_and_the_rest_are_not() -> None:
    assert {status for status in BatchStatus if not ALLOWED[status]} == TERMINAL
    assert all(status.is_terminal == (status in TERMINAL) for status in BatchStatus)


def test_every_status_is_reachable_from_validating() -> None:
    reached, frontier = {BatchStatus.VALIDATING}, [BatchStatus.VALIDATING]
    while frontier:
        for target in ALLOWED[frontier.pop()]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(BatchStatus)


@pytest.mark.parametrize("target", list(BatchStatus), ids=lambda s: s.value)
def test_error_goes_with_failed_and_only_with_failed(target: BatchStatus) -> None:
    source = next((s for s in BatchStatus if target in ALLOWED[s]), None)
    if source is None:
        return  # validating: nothing moves into it
    wrong = None if target is BatchStatus.FAILED else ERROR
    with pytest.raises(ValueError):
        advance(_at(source), target, now=1, error=wrong)


@given(choices=st.lists(st.integers(0, 7), max_size=12), start=st.integers(0, 10**6))
def test_any_walk_keeps_timestamps_and_ends_only_in_terminal_states(choices: list[int], start: int) -> None:
    batch = _new_batch()
    moment = start
    history = [batch]
    for choice in choices:
        options = sorted(ALLOWED[batch.status], key=lambda s: s.value)
        if not options:
            # terminal: every further move is refused and nothing changes
            for target in BatchStatus:
                with pytest.raises(IllegalTransition):
                    advance(batch, target, now=moment, error=_error_for(target))
            break
        target = options[choice % len(options)]
        moment += 1
        moved = advance(batch, target, now=moment, error=_error_for(target))
        stamp = TIMESTAMP_FIELD[target]
        first_time = getattr(batch, stamp) is None
        assert getattr(moved, stamp) == (moment if first_time else getattr(batch, stamp))
        for field in TIMESTAMP_FIELD.values():  # no other timestamp moves
            if field != stamp:
                assert getattr(moved, field) == getattr(batch, field)
        assert (moved.error is not None) == (target is BatchStatus.FAILED)
        batch = moved
        history.append(batch)
    # a status reached as terminal is the last one in the walk
    terminal_at = [i for i, b in enumerate(history) if b.status in TERMINAL]
    assert terminal_at in ([], [len(history) - 1])


def test_resuming_a_finalizing_batch_keeps_its_first_in_progress_time() -> None:
    batch = advance(_new_batch(), BatchStatus.IN_PROGRESS, now=10)
    batch = advance(batch, BatchStatus.FINALIZING, now=20)
    resumed = advance(batch, BatchStatus.IN_PROGRESS, now=30)
    assert (resumed.in_progress_at, resumed.finalizing_at) == (10, 20)


def test_only_the_state_machine_changes_a_status() -> None:
    """No other core module evolves a batch into another status."""
    import re
    from pathlib import Path

    import batchgen.core

    root = Path(batchgen.core.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        # an upload's status (chunked_uploads) is not a batch's
        if path.name != "batch_lifecycle.py"
        and re.search(r"evolve\((?!\s*upload\b)[^)]*\bstatus=", path.read_text())
    ]
    assert offenders == []
