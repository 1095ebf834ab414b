"""The decisions of `wait_for_batch`'s polling loop, shared by both clients, which only get and sleep:

with wait_for_batch(batch_id, ...) as wait:        # a Wait
    while True:
        batch = call(wait.poll())
        on_progress(batch)                         # if wait.on_progress
        if (delay := wait.next_delay(batch)) is None:
            return wait.finish(batch)
        sleep(delay)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self

from batchgen.client import _requests as req
from batchgen.client._exceptions import BatchFailed, BatchWaitTimeout
from batchgen.client._progress import progress_for
from batchgen.client._requests import FAILED_STATUSES, TERMINAL_STATUSES, JSONObject, RequestSpec

__all__ = [
    "ADAPTIVE_POLLING",
    "ProgressCallback",
    "Wait",
    "adaptive_interval",
    "check_poll_interval",
    "finish_wait",
    "is_terminal",
    "poll_delay",
    "wait_for_batch",
]

ProgressCallback = Callable[[JSONObject], object]
"""`on_progress`: called with the batch object after each poll (the async client awaits a
coroutine function's result)."""


def is_terminal(batch: Mapping[str, Any]) -> bool:
    return batch.get("status") in TERMINAL_STATUSES


def finish_wait(batch: JSONObject, *, raise_on_failure: bool) -> JSONObject:
    """The batch `wait_for_batch` returns, or BatchFailed if asked to raise on a failed ending."""
    if raise_on_failure and batch.get("status") in FAILED_STATUSES:
        raise BatchFailed(batch)
    return batch


FIRST_POLL_INTERVAL = 1.0
POLL_INTERVAL_GROWTH = 1.5
MAX_POLL_INTERVAL = 5.0
ADAPTIVE_POLLING = (
    f"{FIRST_POLL_INTERVAL:g} s, then {POLL_INTERVAL_GROWTH:g} times the wait before, "
    f"up to {MAX_POLL_INTERVAL:g} s"
)
"""The waits between polls when no `poll_interval` is given, in words (for docstrings and --help)."""


def adaptive_interval(polls: int) -> float:
    """Seconds to wait after poll number `polls` (1-based) when no `poll_interval` was given:
    short at first, so that a short batch is seen ending soon after it does, and growing to
    `MAX_POLL_INTERVAL`, so that a long one is not asked about too often."""
    exponent = min(polls - 1, 64)  # past the cap long before; no overflow however long the wait
    return min(FIRST_POLL_INTERVAL * POLL_INTERVAL_GROWTH**exponent, MAX_POLL_INTERVAL)


def check_poll_interval(poll_interval: float | None) -> None:
    if poll_interval is not None and poll_interval < 0:
        raise ValueError(f"poll_interval must be >= 0, not {poll_interval}")


def poll_delay(poll_interval: float, deadline: float | None, now: float) -> float | None:
    """Seconds to sleep before the next poll, or None if the deadline (monotonic) has passed."""
    if deadline is None:
        return poll_interval
    remaining = deadline - now
    if remaining <= 0:
        return None
    return min(poll_interval, remaining)


def wait_for_batch(
    batch_id: str,
    poll_interval: float | None = None,
    timeout: float | None = None,
    *,
    raise_on_failure: bool = False,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> Wait:
    """Poll until the batch is completed, failed, expired or cancelled, and return it.

    Polls are `poll_interval` seconds apart; by default (None) the first wait is 1 s, then
    each is 1.5 times the one before, up to 5 s. With `raise_on_failure`, an ending other than
    completed raises `BatchFailed`. If `timeout` seconds pass first, `BatchWaitTimeout` is
    raised (the batch keeps running). `progress` draws a progress line on stderr (None: only
    if stderr is a terminal); `on_progress` is called with the batch after every poll (by the
    async client, awaited if it returns an awaitable).
    """
    return Wait(
        batch_id,
        poll_interval,
        timeout,
        progress=progress,
        raise_on_failure=raise_on_failure,
        on_progress=on_progress,
    )


class Wait:
    """One wait for a batch: its deadline, its progress display (see `progress_for`) and
    `on_progress`, and what ends it.

    Use it as a context manager so that the progress line is ended however the wait ends.
    """

    def __init__(
        self,
        batch_id: str,
        poll_interval: float | None,
        timeout: float | None,
        *,
        progress: bool | None,
        raise_on_failure: bool = False,
        on_progress: ProgressCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_poll_interval(poll_interval)
        self.batch_id = batch_id
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.raise_on_failure = raise_on_failure
        self.on_progress = on_progress
        self._clock = clock
        self._deadline = None if timeout is None else clock() + timeout
        self._progress = progress_for(progress, clock=clock)
        self._polls = 0

    def poll(self) -> RequestSpec:
        """The request for the batch's current state."""
        return req.get_batch(self.batch_id)

    def next_delay(self, batch: JSONObject) -> float | None:
        """Show the polled batch; None once it has ended, else the seconds until the next poll.

        Raises `BatchWaitTimeout` when the wait's timeout has passed.
        """
        if self._progress is not None:
            self._progress.update(batch)
        if is_terminal(batch):
            return None
        self._polls += 1
        interval = self.poll_interval
        if interval is None:
            interval = adaptive_interval(self._polls)
        delay = poll_delay(interval, self._deadline, self._clock())
        if delay is None:
            raise BatchWaitTimeout(self.batch_id, self.timeout or 0.0, batch)
        return delay

    def finish(self, batch: JSONObject) -> JSONObject:
        """The batch the wait returns once it has ended (see `finish_wait`)."""
        return finish_wait(batch, raise_on_failure=self.raise_on_failure)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
