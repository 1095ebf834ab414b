"""The decisions of `wait_for_batch`'s polling loop, shared by both clients, which only get and sleep:

with Wait(batch_id, poll_interval, timeout, progress=progress) as wait:
    batch = get_batch(batch_id)
    while (delay := wait.next_delay(batch)) is not None:
        sleep(delay)
        batch = get_batch(batch_id)
return finish_wait(batch, raise_on_failure=raise_on_failure)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self

from batchgen.client._exceptions import BatchFailed, BatchWaitTimeout
from batchgen.client._progress import progress_for
from batchgen.client._requests import FAILED_STATUSES, TERMINAL_STATUSES, JSONObject

__all__ = ["Wait", "check_poll_interval", "finish_wait", "is_terminal", "poll_delay"]


def is_terminal(batch: Mapping[str, Any]) -> bool:
    return batch.get("status") in TERMINAL_STATUSES


def finish_wait(batch: JSONObject, *, raise_on_failure: bool) -> JSONObject:
    """The batch `wait_for_batch` returns, or BatchFailed if asked to raise on a failed ending."""
    if raise_on_failure and batch.get("status") in FAILED_STATUSES:
        raise BatchFailed(batch)
    return batch


def check_poll_interval(poll_interval: float) -> None:
    if poll_interval < 0:
        raise ValueError(f"poll_interval must be >= 0, not {poll_interval}")


def poll_delay(poll_interval: float, deadline: float | None, now: float) -> float | None:
    """Seconds to sleep before the next poll, or None if the deadline (monotonic) has passed."""
    if deadline is None:
        return poll_interval
    remaining = deadline - now
    if remaining <= 0:
        return None
    return min(poll_interval, remaining)


class Wait:
    """One wait for a batch: its deadline and its progress display (see `progress_for`).

    Use it as a context manager so that the progress line is ended however the wait ends.
    """

    def __init__(
        self,
        batch_id: str,
        poll_interval: float,
        timeout: float | None,
        *,
        progress: bool | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_poll_interval(poll_interval)
        self.batch_id = batch_id
        self.poll_interval = poll_interval
        self.timeout = timeout
        self._clock = clock
        self._deadline = None if timeout is None else clock() + timeout
        self._progress = progress_for(progress, clock=clock)

    def next_delay(self, batch: JSONObject) -> float | None:
        """Show the polled batch; None once it has ended, else the seconds until the next poll.

        Raises `BatchWaitTimeout` when the wait's timeout has passed.
        """
        if self._progress is not None:
            self._progress.update(batch)
        if is_terminal(batch):
            return None
        delay = poll_delay(self.poll_interval, self._deadline, self._clock())
        if delay is None:
            raise BatchWaitTimeout(self.batch_id, self.timeout or 0.0, batch)
        return delay

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
