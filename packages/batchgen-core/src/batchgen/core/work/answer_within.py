"""``answer_within``: await a call for at most a given time, without ever losing a cancel.

``asyncio.wait_for`` on Python 3.11 returns the call's result when the task awaiting it is
cancelled in the same turn of the loop as the call ends: the cancel is lost, and a loop that was
meant to stop goes on (a runner that ``asyncio.run`` cancels at exit never ends). ``asyncio.timeout``
on 3.11 can leave a cancel pending past its block when the deadline and the answer meet. Here the
call runs as a task of its own and the caller only waits for it: a cancel of the caller always
reaches the caller, and cancels the call too. ``read_outcome`` is for tasks left to end on
their own (an abandoned call, a release nobody waits for).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["answer_within", "read_outcome"]

T = TypeVar("T")


async def answer_within(call: Awaitable[T], timeout_s: float) -> T:
    """What ``call`` returns or raises, or TimeoutError once ``timeout_s`` has passed (the call is
    cancelled then, and not waited for: a call hanging on a cut connection can take long to end).
    Cancelling the caller cancels the call and raises CancelledError in the caller, always."""
    task = asyncio.ensure_future(call)
    done: set[asyncio.Future[T]] = set()
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout_s)
    finally:
        if not done:  # timed out, or the caller was cancelled: the call is abandoned
            task.cancel()
            task.add_done_callback(read_outcome)
    if not done:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return task.result()


def read_outcome(task: asyncio.Future[Any]) -> None:
    """A done callback for a task nobody awaits: read its outcome, so that asyncio does not log
    its exception again when the task is collected."""
    if not task.cancelled():
        task.exception()
