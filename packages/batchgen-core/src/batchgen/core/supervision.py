"""Supervision of the service's own background tasks: the scheduler loop and one-shot tasks.

A task run through ``Supervisor.run`` never takes the service's task group down with it: an
exception is logged once with its traceback and recorded. A crash of a critical task (the
scheduler, a batch start that escaped its own handling) means the core has stopped: ``crashed``
names it (the service's health then says so, and /health answers 503), and every listener
registered with ``on_stop`` is told, so the server can exit non-zero and be restarted by its
supervisor (systemd, Kubernetes); the next start resumes every unfinished batch. A crash of a
task that is not critical (aborting one request on the backend) is only logged.

The periodic maintenance jobs have their own supervision, with retries (``maintenance``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("batchgen.service")


class Supervisor:
    """Runs background tasks, logging and recording their crashes."""

    def __init__(self) -> None:
        self.crashed: dict[str, str] = {}
        self._listeners: list[Callable[[str], object]] = []

    def on_stop(self, listener: Callable[[str], object]) -> None:
        """Call ``listener(reason)`` once the core has stopped (at once if it already has)."""
        self._listeners.append(listener)
        if self.crashed:
            listener(self.reason())

    def reason(self) -> str:
        return "; ".join(f"{name} crashed: {error}" for name, error in self.crashed.items())

    async def run(
        self, name: str, function: Callable[..., Awaitable[Any]], *args: Any, critical: bool = True
    ) -> None:
        """Run ``function(*args)``; log a crash with its traceback, and record it when critical."""
        try:
            await function(*args)
        except Exception as exc:
            self.record_crash(name, exc, critical=critical)

    def record_crash(self, name: str, exc: BaseException, *, critical: bool = True) -> None:
        if not critical:
            logger.exception("background task %r failed", name, exc_info=exc)
            return
        logger.critical("background task %r crashed; the batch service has stopped", name, exc_info=exc)
        first = not self.crashed
        self.crashed.setdefault(name, _describe(exc))
        if first:
            reason = self.reason()
            for listener in self._listeners:
                try:
                    listener(reason)
                except Exception:
                    logger.exception("a listener of the service's stop failed")


def _describe(exc: BaseException) -> str:
    """``Type: message`` of the exception, looking inside groups that hold a single one."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
