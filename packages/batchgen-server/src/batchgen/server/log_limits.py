"""Rate-limiting repeated log records, so one fault repeating fast cannot flood the log.

``RepeatFilter`` lets the first ``limit`` records of a kind (same logger, level, source line and
message) through in each ``interval_s``; later ones in that interval are dropped and counted, and
the next record of the kind that is let through says how many were suppressed. A batch's
lifecycle lines (records whose ``event`` is ``batch.…``) are never limited: each batch has a few,
and every one of them says something new; nor is the access log, which is on only when asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

#: Kinds remembered at most; the oldest are forgotten beyond this (bounded memory).
MAX_KINDS = 1024


class RepeatFilter(logging.Filter):
    def __init__(self, limit: int, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.limit = limit
        self.interval_s = interval_s
        self._clock = clock
        self._kinds: dict[
            tuple[object, ...], list[float | int]
        ] = {}  # kind: [window start, let through, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        event = getattr(record, "event", None)
        if (isinstance(event, str) and event.startswith("batch.")) or record.name == "uvicorn.access":
            return True
        kind = (record.name, record.levelno, record.pathname, record.lineno, str(record.msg))
        now = self._clock()
        state = self._kinds.get(kind)
        if state is None or now - state[0] >= self.interval_s:
            dropped = 0 if state is None else int(state[2])
            self._kinds.pop(kind, None)
            if len(self._kinds) >= MAX_KINDS:
                self._kinds.pop(next(iter(self._kinds)))
            self._kinds[kind] = state = [now, 0, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this were suppressed]"
        if state[1] >= self.limit:
            state[2] += 1
            return False
        state[1] += 1
        return True


def limit_repeats(
    limit: int,
    interval_s: float,
    logger_names: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "uvicorn.access"),
) -> None:
    """Add one RepeatFilter to every handler of the named loggers (root included)."""
    repeat_filter = RepeatFilter(limit, interval_s)
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(repeat_filter)
