"""The batches being worked on: their live counters and result files, and every status change.

``BatchTracker`` holds one ``ActiveBatch`` per unfinished batch. Each move of a batch goes through
the state machine (``batches.lifecycle.advance``) and is persisted at once; counters are persisted
in groups (``flush``), since the result files, not the counters, record what finished. A batch that
reaches a terminal status is synced, closed and forgotten once that status is saved.

A status a client has seen never changes afterwards, across restarts too, so callers see a batch's
status only once it is saved. When the metadata store refuses a save (a full disk, an I/O error),
the batch goes on in memory (a failed batch stops working at once), callers keep seeing its last
saved status, and ``flush`` retries the save until it lands; ``unsaved`` says what waits meanwhile.
A restart before it lands resumes the batch from the status callers saw.

A batch's result files are recorded at once, but a storage fault (a database another process
holds locked, a full disk) only delays a record (``record_file``): it waits in ``unrecorded`` and
is saved just before the batch itself, so the batch's saved row never names a file the store does
not hold, and the fault fails nothing (the lines are on disk already, or held until they can be).

Over a store whose calls may wait on a network (``MetadataCalls.in_threads``: PostgreSQL) no save
is made on the event loop. A change is taken at once (``persist`` returns True) and saved by the
saver task (``run_saver``) in a worker thread: its result files' records first, then the batch
with the change's webhook messages, in one write. Until that write lands callers keep seeing the
batch's last saved status (``awaiting_save``); a refused write keeps the change and its messages
for the next try (``flush`` wakes the saver). ``wait_saved`` lets a call that must answer with
the new status (a cancel) wait for it. At shutdown, with the loop serving nothing more, the
last saves are made in place.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import anyio
import attrs

from batchgen.core.batches.deadline_watch import will_miss
from batchgen.core.batches.lifecycle import advance
from batchgen.core.batches.log import log_transition
from batchgen.core.batches.output_order import INPUT
from batchgen.core.batches.progress import ProgressWindow
from batchgen.core.clock import now
from batchgen.core.errors import StorageUnavailable
from batchgen.core.models import Batch, BatchErrorInfo, BatchStatus, FileObject, RequestCounts, Usage
from batchgen.core.scheduling import IntakePool
from batchgen.core.storage import BlobStore, MetadataStore, ResultWriter
from batchgen.core.storage.faults import storage_fault
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.webhook_outbox import OutboxMessage

logger = logging.getLogger("batchgen.service")

#: The statuses whose snapshot carries a pace and an estimated end.
_RUNNING = frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS})


@attrs.define(eq=False)
class ActiveBatch:
    """Live state of a batch being worked on; ``snapshot`` is what callers see."""

    batch: Batch
    output: ResultWriter
    errors: ResultWriter
    input_fd: int | None = None
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: Of those, the requests the result cache answered and their tokens (``result_cache``).
    cached: int = 0
    cached_prompt_tokens: int = 0
    cached_completion_tokens: int = 0
    #: Prompt tokens of the computed lines that the engines' prefix caches served.
    prefix_cached_tokens: int = 0
    in_flight: set[str] = attrs.Factory(set)
    dirty: bool = False
    #: The batch as last saved in the metadata store: the status callers see.
    saved: Batch | None = None
    #: Why the latest save failed, while ``batch`` holds changes not saved yet.
    unsaved_reason: str | None = None
    #: Recent samples of ``finished``, for the pace a running batch's snapshot shows.
    progress: ProgressWindow = attrs.Factory(ProgressWindow)
    #: Records of result files that ``batch`` names and the store does not hold yet (saved first
    #: by the next ``persist``).
    unrecorded: list[FileObject] = attrs.Factory(list)
    #: Changes taken for the saver task (a store across a network), and how many of them are
    #: saved (a change taken while the saver wrote the one before is not).
    changes: int = 0
    saved_changes: int = 0
    #: Webhook messages of changes taken and not saved yet (the saver writes them with the batch).
    unsaved_messages: list[OutboxMessage] = attrs.Factory(list)
    #: Whether the terminal status's webhook messages were made (once, whatever the saves do).
    terminal_messages_made: bool = False

    def __attrs_post_init__(self) -> None:
        if self.saved is None:
            self.saved = self.batch

    @property
    def awaiting_save(self) -> bool:
        """Whether a change was taken whose write has not landed yet."""
        return self.changes != self.saved_changes

    @property
    def saved_terminal(self) -> bool:
        """Whether the store already holds a terminal status for this batch."""
        return self.saved is not None and self.saved.status.is_terminal

    @property
    def id(self) -> str:
        return self.batch.id

    @property
    def status(self) -> BatchStatus:
        return self.batch.status

    @property
    def finished(self) -> int:
        return self.completed + self.failed

    def state(self) -> Batch:
        """The batch as it is now, with its live counters (what a save writes)."""
        return self._with_counters(self.batch)

    def snapshot(self) -> Batch:
        """What callers see: the batch as last saved (its status never runs ahead of the store),
        with its live counters."""
        assert self.saved is not None
        shown = self.batch if self.unsaved_reason is None and not self.awaiting_save else self.saved
        batch = self._with_counters(shown)
        if batch.status not in _RUNNING:  # ended, or cancelling: no time left to predict
            return batch
        wall_now = time.time()
        progress = self.progress.estimate(self.finished, batch.request_counts.total, wall_now)
        return attrs.evolve(batch, progress=progress, at_risk=will_miss(batch, progress, wall_now))

    def _with_counters(self, batch: Batch) -> Batch:
        return attrs.evolve(
            batch,
            request_counts=RequestCounts(batch.request_counts.total, self.completed, self.failed),
            usage=Usage(
                self.prompt_tokens,
                self.completion_tokens,
                self.cached,
                self.cached_prompt_tokens,
                self.cached_completion_tokens,
                self.prefix_cached_tokens,
            ),
        )


class BatchTracker:
    """The unfinished batches, and the one path by which their status changes."""

    def __init__(
        self,
        metadata: MetadataStore,
        blobs: BlobStore,
        intake_pool: IntakePool,
        abort_request: Callable[[str], object],
        *,
        outbox: Callable[[Batch], Sequence[OutboxMessage]] | None = None,
        on_end: Callable[[str], object] | None = None,
        calls: MetadataCalls | None = None,
    ) -> None:
        """``outbox(batch)``: the webhook messages to save with a batch's terminal status, in the
        same write; ``on_end(batch_id)``: called when a batch reaches a terminal status;
        ``calls``: how the store is called (in worker threads: saves go through ``run_saver``)."""
        self._calls = calls if calls is not None and calls.in_threads else None
        self._wake_saver = anyio.Event() if self._calls is not None else None
        self._saves_landed = anyio.Event() if self._calls is not None else None
        self._outbox = outbox
        self._on_end = on_end
        self._metadata = metadata
        self._blobs = blobs
        self._intake_pool = intake_pool
        self._abort_request = abort_request
        self._active: dict[str, ActiveBatch] = {}
        #: Ends a batch whose results go in input order (``output_order: "input"``): rewrites its
        #: files, then moves it to the status given (``ordering_step.OrderingStep.begin``).
        self.end_in_order: Callable[[ActiveBatch, BatchStatus], object] | None = None
        #: The storage fault behind the latest refused save (what ``flush`` raises while one waits).
        self._last_fault: StorageUnavailable | None = None

    # --- membership ------------------------------------------------------------------------
    def track(self, batch: Batch) -> ActiveBatch:
        active = ActiveBatch(
            batch=batch,
            output=self._blobs.open_result_writer(self._blobs.output_path(batch.id)),
            errors=self._blobs.open_result_writer(self._blobs.error_path(batch.id)),
        )
        self._active[batch.id] = active
        return active

    def counts_restored(self, active: ActiveBatch) -> None:
        """The batch's counters were rebuilt from its result files (a restart): that work was
        done before, so it does not count in the batch's pace."""
        active.progress.restart(active.finished)

    def get(self, batch_id: str) -> ActiveBatch | None:
        return self._active.get(batch_id)

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._active

    def __iter__(self) -> Iterator[ActiveBatch]:
        return iter(list(self._active.values()))

    def __len__(self) -> int:
        return len(self._active)

    # --- status changes --------------------------------------------------------------------
    def move(self, active: ActiveBatch, target: BatchStatus, *, error: BatchErrorInfo | None = None) -> None:
        """Advance the batch to ``target`` and persist it; a terminal status also ends tracking."""
        if target.is_terminal:
            self._close(active)
            if self._on_end is not None:
                self._on_end(active.id)
        previous, moment = active.status, now()
        active.batch = advance(active.batch, target, now=moment, error=error)
        log_transition(active.state(), previous, moment)
        if self.persist(active) and target.is_terminal and not active.awaiting_save:
            self._active.pop(active.id, None)  # else kept until ``flush`` or the saver saves it

    def cancel(self, active: ActiveBatch) -> None:
        """Drop the batch's queued requests and abort those in flight; it ends once they have."""
        self.move(active, BatchStatus.CANCELLING)
        self.stop_work(active)
        self.settle(active)

    def fail(self, active: ActiveBatch, code: str, message: str) -> None:
        """End the batch as failed (once: a batch that already ended stays as it is)."""
        if active.status.is_terminal:
            return
        self.stop_work(active)
        self.move(active, BatchStatus.FAILED, error=BatchErrorInfo(code, message))

    def expire(self, active: ActiveBatch) -> None:
        """End a batch past its completion window; the lines written so far stay."""
        self.stop_work(active)
        self.move(active, BatchStatus.EXPIRED)

    def settle(self, active: ActiveBatch) -> None:
        """End the batch if nothing is left to do: every request has its line, or a cancel drained.

        Called as each of its requests ends, so its pace is sampled here."""
        active.progress.record(active.finished)
        status = active.status
        if status is BatchStatus.IN_PROGRESS and active.finished >= active.batch.request_counts.total:
            self.move(active, BatchStatus.FINALIZING)
            self._end(active, BatchStatus.COMPLETED)
        elif status is BatchStatus.CANCELLING and not active.in_flight:
            self._end(active, BatchStatus.CANCELLED)

    def _end(self, active: ActiveBatch, target: BatchStatus) -> None:
        """Move a batch whose last line is written to ``target``: at once, or once its files are in
        input order when it asked for that."""
        if active.batch.output_order == INPUT and self.end_in_order is not None:
            self.end_in_order(active, target)
        else:
            self.move(active, target)

    def stop_work(self, active: ActiveBatch) -> None:
        """Drop the batch's queued requests and abort those in flight (they end with no line)."""
        self._intake_pool.drop(active.id)
        for request_id in list(active.in_flight):
            self._abort_request(request_id)

    # --- persistence -----------------------------------------------------------------------
    def record_file(self, active: ActiveBatch, file: FileObject, kind: str) -> None:
        """Save the record of the batch's ``kind`` ("output" or "error") result file, which the
        batch names from now on. On a storage fault (another process holds the database locked,
        a full disk) the record waits in ``unrecorded`` for the batch's next save, which retries
        it until it lands; anything else is raised. With a saver, the record always waits in
        ``unrecorded`` for the batch's next save."""
        if self._calls is not None:
            active.unrecorded.append(file)
        else:
            try:
                self._metadata.insert_file(file)
            except Exception as exc:
                if storage_fault(exc) is None:
                    raise
                # said once for the batch by its refused save (``persist``), which comes next
                logger.debug(
                    "batch %s: its %s file is recorded once the store takes it: %s", active.id, kind, exc
                )
                active.unrecorded.append(file)
        if kind == "output":
            active.batch = attrs.evolve(active.batch, output_file_id=file.id)
        else:
            active.batch = attrs.evolve(active.batch, error_file_id=file.id)

    def persist(self, active: ActiveBatch, messages: Sequence[OutboxMessage] = ()) -> bool:
        """Save the batch (its unrecorded result files first), with ``messages`` (webhook events
        of this change, in the same write); on a storage fault keep it unsaved (``flush`` retries,
        without the messages) and return False. With a saver the change is taken for it (True)."""
        if self._calls is not None:
            active.unsaved_messages.extend(messages)
            active.changes += 1
            active.dirty = False
            self._wake()
            return True
        return self._save_now(active, messages)

    def _save_now(self, active: ActiveBatch, messages: Sequence[OutboxMessage] = ()) -> bool:
        state = active.state()
        try:
            while active.unrecorded:
                self._metadata.insert_file(active.unrecorded[0])
                active.unrecorded.pop(0)
            self.save(
                state,
                first_terminal=state.status.is_terminal
                and not active.saved_terminal
                and not active.terminal_messages_made,  # (the saver's: among ``messages`` then)
                messages=messages,
            )
        except Exception as exc:
            self._refused(active, state, exc)
            return False
        self._landed(active, state)
        active.dirty = False
        active.saved_changes = active.changes
        active.unsaved_messages.clear()
        return True

    def _refused(self, active: ActiveBatch, state: Batch, exc: Exception) -> None:
        """A save of ``state`` failed with ``exc``: a storage fault keeps the batch unsaved (said
        once until it is saved again); anything else is raised."""
        fault = storage_fault(exc, f"save batch {active.id}")
        if fault is None:
            raise exc
        if active.unsaved_reason is None:
            logger.warning("batch %s (%s) is not saved yet: %s", active.id, state.status.value, fault)
        active.unsaved_reason = fault.message
        self._last_fault = fault

    @staticmethod
    def _landed(active: ActiveBatch, state: Batch) -> None:
        """A save of ``state`` landed: it is what callers see now."""
        if active.unsaved_reason is not None:
            logger.info("batch %s (%s) is saved again", active.id, state.status.value)
        active.saved = state
        active.unsaved_reason = None

    def save(self, batch: Batch, *, first_terminal: bool, messages: Sequence[OutboxMessage] = ()) -> None:
        """Save the batch, with ``messages``; the first save of a terminal status carries its
        webhook messages too."""
        if first_terminal and self._outbox is not None:
            messages = (*messages, *self._outbox(batch))
        if messages:
            self._metadata.save_batch(batch, outbox=messages)
        else:
            self._metadata.save_batch(batch)

    def flush(self) -> None:
        """Save every batch whose counters moved or whose last save failed; a batch that ended is
        forgotten once saved. Raise ``StorageUnavailable`` if a save still fails, so the maintenance
        job reports it as the storage fault it is."""
        failures: list[str] = []
        for active in self:
            if not (active.dirty or active.unsaved_reason is not None):
                continue
            if self.persist(active):
                if active.status.is_terminal and not active.awaiting_save:
                    self._active.pop(active.id, None)
            else:
                failures.append(f"batch {active.id}: {active.unsaved_reason}")
        if self._calls is not None:  # the saver's refused writes
            failures = [
                f"batch {active.id}: {active.unsaved_reason}" for active in self if active.unsaved_reason
            ]
        if failures:
            fault = self._last_fault
            raise StorageUnavailable(
                f"{len(failures)} batch(es) not saved: {failures[0]}",
                disk_full=fault is not None and fault.disk_full,
                **({} if fault is None else {"retry_after_s": fault.retry_after_s}),
            )

    # --- the saver (a store across a network) ----------------------------------------------
    def _wake(self) -> None:
        if self._wake_saver is not None:
            self._wake_saver.set()

    def _take_messages(self, active: ActiveBatch) -> list[OutboxMessage]:
        """The messages a write of the batch now carries: those of changes not saved yet, and
        once, with its terminal status, the terminal event's."""
        if active.status.is_terminal and not active.saved_terminal and not active.terminal_messages_made:
            active.terminal_messages_made = True
            if self._outbox is not None:
                active.unsaved_messages.extend(self._outbox(active.state()))
        return list(active.unsaved_messages)

    async def run_saver(self) -> None:
        """Save the changes taken, in worker threads, until cancelled (a store across a network)."""
        assert self._calls is not None and self._wake_saver is not None
        while True:
            await self._wake_saver.wait()
            self._wake_saver = anyio.Event()
            for active in [active for active in self if active.awaiting_save or active.unsaved_reason]:
                await self._save_in_thread(active)
            landed, self._saves_landed = self._saves_landed, anyio.Event()
            if landed is not None:
                landed.set()

    async def _save_in_thread(self, active: ActiveBatch) -> None:
        assert self._calls is not None
        taken, state = active.changes, active.state()
        messages = self._take_messages(active)
        files, recorded = list(active.unrecorded), []
        metadata = self._metadata

        def write() -> None:
            for file in files:
                metadata.insert_file(file)
                recorded.append(file)
            if messages:
                metadata.save_batch(state, outbox=messages)
            else:
                metadata.save_batch(state)

        try:
            await self._calls(write)
        except Exception as exc:
            self._refused(active, state, exc)
            return
        finally:
            active.unrecorded = [file for file in active.unrecorded if file not in recorded]
        del active.unsaved_messages[: len(messages)]
        self._landed(active, state)
        active.saved_changes = taken
        if state.status.is_terminal and not active.awaiting_save:
            self._active.pop(active.id, None)

    async def wait_saved(self, active: ActiveBatch) -> None:
        """Until the changes taken so far are saved, or a write of them was refused."""
        while active.awaiting_save and active.unsaved_reason is None and self._saves_landed is not None:
            await self._saves_landed.wait()

    def unsaved(self) -> dict[str, str]:
        """Batches whose latest status or counters the store has not taken yet, with the reason."""
        return {active.id: active.unsaved_reason for active in self if active.unsaved_reason is not None}

    def open_writers(self) -> list[ResultWriter]:
        return [writer for active in self for writer in (active.output, active.errors) if writer.opened]

    def close_all(self) -> None:
        """At shutdown: persist and close every batch, leaving it unfinished for the next start
        (in place: the event loop serves nothing more)."""
        for active in self:
            if not self._save_now(active, list(active.unsaved_messages)):
                logger.error(
                    "batch %s could not be saved at shutdown; the next start resumes it from its "
                    "last saved status (%s)",
                    active.id,
                    active.snapshot().status.value,
                )
            self._close(active)
        self._active.clear()

    def _close(self, active: ActiveBatch) -> None:
        for writer in (active.output, active.errors):
            try:
                writer.close()
            except OSError:
                logger.exception("closing %s failed", writer.path)
        if active.input_fd is not None:
            os.close(active.input_fd)
            active.input_fd = None
