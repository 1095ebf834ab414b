"""Crash recovery: on start, resume every batch a previous run left unfinished.

The result files are the record of what finished: a torn last line is cut off, the custom_ids of
the complete lines are read, the counters are rebuilt from them, and only the other requests are
queued again. A batch that was cancelling ends cancelled; one whose input file is gone fails.
A batch whose results go in input order and that was finalizing or cancelling (its rewrite may have
been cut short) has that rewrite run again before it ends; a half-made ordered copy is deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from batchgen.core.batches.lifecycle import advance
from batchgen.core.batches.log import log_transition
from batchgen.core.batches.output_order import INPUT, remove_leftovers
from batchgen.core.batches.starter import BatchStarter
from batchgen.core.batches.tracker import ActiveBatch, BatchTracker
from batchgen.core.clock import now
from batchgen.core.models import BatchStatus
from batchgen.core.storage import BlobStore, MetadataStore
from batchgen.core.storage.result_files import FinishedLines

logger = logging.getLogger("batchgen.service")


def recover(
    metadata: MetadataStore,
    blobs: BlobStore,
    tracker: BatchTracker,
    starter: BatchStarter,
    spawn: Callable[..., object],
    end_in_order: Callable[[ActiveBatch, BatchStatus], object] | None = None,
) -> None:
    """Track every unfinished batch again and start queueing what each still has to run.

    ``spawn(async_fn, *args)`` runs the (slow: it reads the input file) start in the background;
    ``end_in_order(active, status)`` rewrites an ordered batch's files, then ends it.
    """
    folders: set[Path] = set()
    for batch in metadata.active_batches():
        if batch.output_order == INPUT:
            folders.add(blobs.output_path(batch.id).parent)
    for folder in folders:
        remove_leftovers(folder)
    for batch in metadata.active_batches():
        if batch.status is BatchStatus.CANCELLING and batch.output_order == INPUT and end_in_order:
            cancelling = tracker.track(batch)
            restore_counts(blobs, cancelling)
            tracker.counts_restored(cancelling)
            end_in_order(cancelling, BatchStatus.CANCELLED)
            continue
        if batch.status is BatchStatus.CANCELLING:
            moment = now()
            cancelled = advance(batch, BatchStatus.CANCELLED, now=moment)
            tracker.save(cancelled, first_terminal=True)
            log_transition(cancelled, batch.status, moment)
            continue
        active = tracker.track(batch)
        file = metadata.get_file(batch.input_file_id)
        if file is None:
            tracker.fail(active, "batch_failed", "The batch's input file is gone.")
            continue
        written, separate = restore_counts(blobs, active)
        tracker.counts_restored(active)
        if batch.status is BatchStatus.FINALIZING:
            active.batch = advance(batch, BatchStatus.IN_PROGRESS, now=now())
        logger.info("resuming batch %s: %d lines already written", batch.id, active.finished)
        # Hold its room now, before any new create can take it (the start indexes in the background).
        starter.reserve(active, max(0, batch.request_counts.total - active.finished))
        spawn(starter.start, active, file, set(written.custom_ids) | set(separate.custom_ids))


def restore_counts(blobs: BlobStore, active: ActiveBatch) -> tuple[FinishedLines, FinishedLines]:
    """Rebuild the batch's counters from its result files (a torn last line is cut off first);
    return what the output and error files hold."""
    written = blobs.read_finished(active.output.path)
    separate = blobs.read_finished(active.errors.path)  # failed lines under OpenAI's convention
    active.completed = written.completed + separate.completed
    active.failed = written.failed + separate.failed
    active.prompt_tokens = written.prompt_tokens
    active.completion_tokens = written.completion_tokens
    active.cached = written.cached
    active.cached_prompt_tokens = written.cached_prompt_tokens
    active.cached_completion_tokens = written.cached_completion_tokens
    active.prefix_cached_tokens = written.prefix_cached_tokens
    return written, separate
