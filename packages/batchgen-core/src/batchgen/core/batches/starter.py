"""Starting a batch: index its input file, queue what is still to run, move it to in_progress.

A new batch queues every line; a batch resumed after a restart queues only the lines whose
custom_id has no result line yet, each once, in the same prefix-grouped order
(``intake_pool.line_order``) as a new batch's lines. The room a batch was given when it was accepted (its intake
reservation) becomes its queued requests here; a batch that ends before that gives it back.
While another process holds the database locked, the batch's output file record and its move to
in_progress wait in memory and are saved once the lock is gone (``BatchTracker.record_file``);
the batch runs meanwhile. Whatever else goes wrong while starting one batch (its input cannot be
read, its output file cannot be recorded on a full disk, a bug) fails that batch with the reason
and is logged with its traceback; it never reaches the service's other tasks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import anyio
import msgspec

from batchgen.core.batches.tracker import ActiveBatch, BatchTracker
from batchgen.core.files.batch_file import LineIndex, index_batch_file
from batchgen.core.files.catalogue import FileCatalogue
from batchgen.core.models import BatchStatus, FileObject
from batchgen.core.scheduling import IntakePool
from batchgen.core.scheduling.deadline_turns import deadline_slot
from batchgen.core.scheduling.intake_pool import LineOrder, line_order

_decode = msgspec.json.Decoder().decode
logger = logging.getLogger("batchgen.service")


def lines_not_done(path: str, index: LineIndex, done: set[str]) -> list[int]:
    """Positions of the request lines whose custom_id has no output or error line yet."""
    pending: list[int] = []
    with open(path, "rb") as stream:
        for position, (offset, length) in enumerate(zip(index.offsets, index.lengths, strict=True)):
            stream.seek(offset)
            if _decode(stream.read(length))["custom_id"] not in done:
                pending.append(position)
    return pending


def read_input(path: str, done: set[str] | None, group_prefixes: bool = True) -> tuple[LineIndex, LineOrder]:
    """The input file's index, and the lines to queue (those not in ``done``) in admission order,
    checked and, with ``group_prefixes``, grouped by prompt prefix (``intake_pool.line_order``):
    the work of a batch start that reads the file, in one call so that it runs in one worker thread."""
    index = index_batch_file(path, with_prefixes=group_prefixes)
    lines = lines_not_done(path, index, done) if done else None
    return index, line_order(index, lines)


class BatchStarter:
    """Queues a tracked batch's requests in the intake pool."""

    def __init__(
        self,
        tracker: BatchTracker,
        files: FileCatalogue,
        intake_pool: IntakePool,
        wake_scheduler: Callable[[], None],
        *,
        on_queued: Callable[[str], object] | None = None,
        group_prefixes: bool = True,
    ) -> None:
        """``on_queued(batch_id)`` is called once a batch's requests are queued; ``group_prefixes``:
        a batch's lines of one prompt prefix are admitted together (else in file order)."""
        self._on_queued = on_queued
        self._group_prefixes = group_prefixes
        self._tracker = tracker
        self._files = files
        self._intake_pool = intake_pool
        self._wake_scheduler = wake_scheduler

    async def start(self, active: ActiveBatch, file: FileObject, done: set[str] | None = None) -> None:
        """Index the input, queue the requests not in ``done``, and move the batch to in_progress;
        on any failure, fail the batch with the reason."""
        try:
            await self._start_reserved(active, file, done)
        except Exception as exc:
            logger.exception("batch %s could not be started", active.id)
            self._intake_pool.drop(active.id)
            self._tracker.fail(active, "batch_failed", f"The batch could not be started: {exc}")

    async def _start_reserved(self, active: ActiveBatch, file: FileObject, done: set[str] | None) -> None:
        try:
            await self._start(active, file, done)
        finally:  # queued, failed or interrupted: the reservation is spent either way
            self._intake_pool.release(active.id)

    def reserve(self, active: ActiveBatch, requests: int) -> bool:
        """Hold intake room for a batch about to be started; False (holding nothing) if it does not fit."""
        if requests > self._intake_pool.free:
            return False
        self._intake_pool.reserve(active.id, requests, active.batch.owner)
        return True

    async def _start(self, active: ActiveBatch, file: FileObject, done: set[str] | None) -> None:
        try:
            index, order = await anyio.to_thread.run_sync(read_input, file.path, done, self._group_prefixes)
        except OSError as exc:
            self._tracker.fail(active, "batch_failed", f"Could not read the input file: {exc}")
            return
        if active.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            return  # cancelled or ended while indexing
        pending = len(order.positions)
        room = self._intake_pool.free + self._intake_pool.reserved_for(active.id)
        if pending > room:
            capacity = self._intake_pool.capacity
            if pending > capacity:
                message = (
                    f"The batch has {pending} requests but the intake pool has room for {capacity} at "
                    f"most (its whole capacity), so it can never fit: do not retry it; split the file "
                    f"into batches of at most {capacity} requests."
                )
            else:
                message = (
                    f"The batch has {pending} requests to queue but the intake pool has room for "
                    f"{room} of {capacity}. Retry later or split the file."
                )
            self._tracker.fail(active, "capacity_exceeded", message)  # releases the reservation too
            return
        if active.input_fd is None:
            active.input_fd = os.open(file.path, os.O_RDONLY)
        if active.batch.output_file_id is None:
            self._tracker.record_file(
                active, self._files.result_file(active.batch, active.output.path, "output"), "output"
            )
        if active.batch.error_file_id is None and _has_lines(active.errors.path):
            # error lines written before the previous run could record their file (a restart)
            self._tracker.record_file(
                active, self._files.result_file(active.batch, active.errors.path, "error"), "error"
            )
        if active.status is BatchStatus.VALIDATING:
            self._tracker.move(active, BatchStatus.IN_PROGRESS)
        else:
            self._tracker.persist(active)
        deadline = deadline_slot(active.batch.created_at, active.batch.expires_at)
        self._intake_pool.add(active.id, index, order, tenant=active.batch.owner, deadline=deadline)
        if self._on_queued is not None:
            self._on_queued(active.id)
        self._wake_scheduler()
        self._tracker.settle(active)


def _has_lines(path: os.PathLike[str] | str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False
