"""The step between an ``output_order: "input"`` batch's last line and its end.

When such a batch has every line (``finalizing``), or a cancel has drained (``cancelling``), the
tracker hands it here instead of ending it: its output and error files are rewritten in input
order in a worker thread (``output_order.rewrite_in_input_order``), and only then does the batch
reach ``completed`` or ``cancelled``. The status shown meanwhile is ``finalizing`` or
``cancelling`` and the files serve as they were appended, so a client that sees the end status
downloads the ordered file. A crash meanwhile leaves the batch in that status; the next start
resumes it and the rewrite runs again (``recovery``). Expired and failed batches are not
rewritten: they stop at once, and a failure is often the disk itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from batchgen.core.batches.output_order import UnorderableResults, rewrite_in_input_order
from batchgen.core.batches.tracker import ActiveBatch, BatchTracker
from batchgen.core.models import BatchStatus
from batchgen.core.storage import MetadataStore
from batchgen.core.storage.faults import storage_fault
from batchgen.core.storage.metadata_calls import MetadataCalls

logger = logging.getLogger("batchgen.service")


class OrderingStep:
    """Rewrites ordered batches' result files, then ends them."""

    def __init__(
        self,
        tracker: BatchTracker,
        metadata: MetadataStore,
        calls: MetadataCalls,
        spawn: Callable[..., object],
    ) -> None:
        """``spawn(async_fn, *args)`` runs the rewrite in the background; the input file's record
        is read through ``calls``."""
        self._tracker = tracker
        self._metadata = metadata
        self._calls = calls
        self._spawn = spawn
        #: Batches whose rewrite is under way.
        self._running: set[str] = set()

    def begin(self, active: ActiveBatch, target: BatchStatus) -> None:
        """Rewrite the batch's files, then move it to ``target`` (once, however often asked)."""
        if active.id in self._running:
            return
        self._running.add(active.id)
        self._spawn(self._finish, active, target)

    def running(self, batch_id: str) -> bool:
        return batch_id in self._running

    async def _finish(self, active: ActiveBatch, target: BatchStatus) -> None:
        try:
            await self._rewrite(active, target)
        finally:
            self._running.discard(active.id)

    async def _rewrite(self, active: ActiveBatch, target: BatchStatus) -> None:
        file = await self._calls(self._metadata.get_file, active.batch.input_file_id)
        paths = [active.output.path, active.errors.path]
        started = time.perf_counter()
        try:
            if file is None:
                raise FileNotFoundError("the batch's input file is gone")
            lines = 0
            for path in paths:
                lines += (await anyio.to_thread.run_sync(rewrite_in_input_order, file.path, path)).lines
        except Exception as exc:
            reason: Any = exc
            fault = storage_fault(exc, f"put batch {active.id}'s results in input order")
            if fault is not None:
                reason = fault.message
            elif not isinstance(exc, UnorderableResults | OSError):
                logger.exception("batch %s: the ordered rewrite raised", active.id)
            if not active.status.is_terminal:
                self._tracker.fail(
                    active,
                    "batch_failed",
                    f"The results could not be put in input order: {reason}. Every line is kept, in "
                    "the order the requests finished.",
                )
            return
        logger.info(
            "batch %s: %d result lines put in input order in %.2f s",
            active.id,
            lines,
            time.perf_counter() - started,
        )
        if active.status.is_terminal:
            return
        self._tracker.move(active, target)
