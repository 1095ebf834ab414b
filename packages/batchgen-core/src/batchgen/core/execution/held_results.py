"""Result lines the storage refused (a full disk), kept in memory until it takes them again.

When appending a file's result lines fails on a storage fault (``storage.faults``: a full disk,
an I/O error, a read-only folder), the executor neither fails the batch nor drops the lines: it
holds them here, and work pauses. While anything is held the scheduler admits no new request
(the executor's ``on_pause``), lines of the requests still running join the held ones without
touching the disk, and the service's health is 503 naming the fault. The executor's
``write_held`` (a maintenance job, every ``RETRY_INTERVAL_S``) appends them again, oldest first;
once every held line is written, work resumes by itself. What is held is bounded by the requests
admitted before the pause (the scheduling pool's slots), since nothing new is admitted meanwhile.

A held request stays in its batch's ``in_flight`` until its line is written, so its batch cannot
end without it (a cancel waits for it). A batch that ended meanwhile (expired, failed) drops its
held lines, as it drops any line that ends after it. A process stopped while lines are held leaves
them unwritten, and the next start runs those requests again (their lines are not in the files).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import attrs

from batchgen.core.batches.tracker import ActiveBatch
from batchgen.core.errors import StorageUnavailable
from batchgen.core.storage import ResultWriter

logger = logging.getLogger("batchgen.service")

#: Seconds between two tries at writing the held lines.
RETRY_INTERVAL_S = 1.0


@attrs.define(eq=False)
class PendingLines:
    """Result lines for one file, not written yet."""

    active: ActiveBatch
    writer: ResultWriter
    data: bytes
    lines: int
    #: The requests whose lines these are (error lines of requests never run have none).
    request_ids: tuple[str, ...]
    #: Moves the batch's counters (and the result cache) for these lines, once they are written.
    count: Callable[[], None]


class HeldResults:
    """The lines held while the storage refuses them, oldest first, and the fault behind it."""

    def __init__(self, on_pause: Callable[[bool], object] | None = None) -> None:
        """``on_pause(True)`` when the first lines are held, ``on_pause(False)`` once all are written."""
        self._on_pause = on_pause
        self._held: deque[PendingLines] = deque()
        self._request_ids: set[str] = set()
        self._lines = 0
        #: The storage fault that paused work (the latest refusal's), None while nothing is held.
        self.fault: StorageUnavailable | None = None

    @property
    def paused(self) -> bool:
        return self.fault is not None

    @property
    def lines(self) -> int:
        """How many result lines are held."""
        return self._lines

    def holds(self, request_id: str) -> bool:
        return request_id in self._request_ids

    def hold(self, pending: PendingLines, fault: StorageUnavailable | None = None) -> None:
        """Keep ``pending`` until the storage takes it; ``fault``: why the storage refused it
        (None: held behind lines held already)."""
        self._held.append(pending)
        self._request_ids.update(pending.request_ids)
        self._lines += pending.lines
        if fault is None or self.fault is not None:
            self.fault = self.fault or fault
            return
        self.fault = fault
        logger.warning(
            "work paused: result lines are held in memory until the storage takes them again "
            "(retried every %.1f s): %s",
            RETRY_INTERVAL_S,
            fault.message,
        )
        if self._on_pause is not None:
            self._on_pause(True)

    def oldest(self) -> PendingLines | None:
        return self._held[0] if self._held else None

    def release_oldest(self) -> PendingLines:
        """Take the oldest held lines out of the hold (written, or their batch ended)."""
        pending = self._held.popleft()
        self._request_ids.difference_update(pending.request_ids)
        self._lines -= pending.lines
        return pending

    def refused(self, fault: StorageUnavailable) -> None:
        """The storage refused the held lines again."""
        self.fault = fault

    def resume_if_empty(self) -> None:
        """End the pause once nothing is held."""
        if self._held or self.fault is None:
            return
        self.fault = None
        logger.info("work resumed: the storage takes result lines again, and every held line is written")
        if self._on_pause is not None:
            self._on_pause(False)
