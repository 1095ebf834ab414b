"""Periodic maintenance under supervision: counter flushes, grouped fsyncs, expiry.

Each job runs every ``interval_s`` in its own loop. A job that raises runs again at its next
interval; one that fails ``unhealthy_after`` times in a row is reported by ``failing()`` (the
service's health then says so) until it succeeds again. A failing job never stops silently.

How a failure is logged depends on what it is. A bug is logged with its traceback each time. A
storage fault (a full disk, a database another process holds locked: ``storage.faults``) is not a
bug and passes by itself: the job logs one warning when it starts failing and one line when it
works again, with no traceback, and ``storage_faults()`` names the fault while it lasts, so the
service can report it as the storage being unavailable.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import attrs

from batchgen.core.errors import StorageUnavailable
from batchgen.core.storage.faults import storage_fault

logger = logging.getLogger("batchgen.service")

Job = Callable[[], Awaitable[None] | None]


@attrs.define
class _JobState:
    consecutive_failures: int = 0
    last_error: str | None = None
    #: The storage fault behind the latest failure, while the failures are storage faults.
    storage_fault: StorageUnavailable | None = None


class Maintenance:
    """Named periodic jobs, supervised."""

    def __init__(self, *, unhealthy_after: int = 3) -> None:
        self._unhealthy_after = unhealthy_after
        self._jobs: dict[str, tuple[float, Job]] = {}
        self._states: dict[str, _JobState] = {}

    def add(self, name: str, interval_s: float, job: Job) -> None:
        self._jobs[name] = (interval_s, job)
        self._states[name] = _JobState()

    def start(self, tasks: anyio.abc.TaskGroup) -> None:
        for name in self._jobs:
            tasks.start_soon(self._run, name, name=f"maintenance:{name}")

    def failing(self) -> dict[str, str]:
        """Jobs that failed ``unhealthy_after`` times in a row, with their last error."""
        return {
            name: state.last_error or ""
            for name, state in self._states.items()
            if state.consecutive_failures >= self._unhealthy_after
        }

    def storage_faults(self) -> dict[str, StorageUnavailable]:
        """Jobs whose latest run failed on a storage fault, with the fault (reported at once: a
        storage fault is known for what it is on its first failure)."""
        return {
            name: state.storage_fault
            for name, state in self._states.items()
            if state.consecutive_failures and state.storage_fault is not None
        }

    async def run_once(self, name: str) -> bool:
        """Run one job now; return whether it succeeded (a failure is logged and counted)."""
        _, job = self._jobs[name]
        state = self._states[name]
        try:
            outcome = job()
            if inspect.isawaitable(outcome):
                await outcome
        except Exception as exc:
            self._failed(name, state, exc)
            return False
        if state.storage_fault is not None:
            logger.info("maintenance job %r works again: the storage takes writes again", name)
        elif state.consecutive_failures >= self._unhealthy_after:
            logger.info("maintenance job %r works again", name)
        state.consecutive_failures = 0
        state.last_error = None
        state.storage_fault = None
        return True

    def _failed(self, name: str, state: _JobState, exc: Exception) -> None:
        fault = storage_fault(exc)
        first_of_kind = state.consecutive_failures == 0 or (fault is None) != (state.storage_fault is None)
        state.consecutive_failures += 1
        state.storage_fault = fault
        if fault is None:
            state.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("maintenance job %r failed (%d in a row)", name, state.consecutive_failures)
            return
        state.last_error = fault.message
        if first_of_kind:  # once: it is retried every interval until the storage takes it
            logger.warning(
                "maintenance job %r waits for the storage (retried every %.1f s): %s",
                name,
                self._jobs[name][0],
                fault.message,
            )

    async def _run(self, name: str) -> None:
        interval_s, _ = self._jobs[name]
        while True:
            await anyio.sleep(interval_s)
            await self.run_once(name)
