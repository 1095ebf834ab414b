"""Periodic maintenance under supervision: counter flushes, grouped fsyncs, expiry.

Each job runs every ``interval_s`` in its own loop. A job that raises is logged with its traceback
and runs again at its next interval; one that fails ``unhealthy_after`` times in a row is reported
by ``failing()`` (the service's health then says so) until it succeeds again. A failing job
never stops silently.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import attrs

logger = logging.getLogger("batchgen.service")

Job = Callable[[], Awaitable[None] | None]


@attrs.define
class _JobState:
    consecutive_failures: int = 0
    last_error: str | None = None


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

    async def run_once(self, name: str) -> bool:
        """Run one job now; return whether it succeeded (a failure is logged and counted)."""
        _, job = self._jobs[name]
        state = self._states[name]
        try:
            outcome = job()
            if inspect.isawaitable(outcome):
                await outcome
        except Exception as exc:
            state.consecutive_failures += 1
            state.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("maintenance job %r failed (%d in a row)", name, state.consecutive_failures)
            return False
        if state.consecutive_failures >= self._unhealthy_after:
            logger.info("maintenance job %r works again", name)
        state.consecutive_failures = 0
        state.last_error = None
        return True

    async def _run(self, name: str) -> None:
        interval_s, _ = self._jobs[name]
        while True:
            await anyio.sleep(interval_s)
            await self.run_once(name)
