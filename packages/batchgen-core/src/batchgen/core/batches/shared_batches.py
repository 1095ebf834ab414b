"""Batches shared by replicas, as any replica answers for them: record, ledger work, ending.

In one process, a running batch lives in that process (``batches.tracker``). Shared by several
replicas, it lives in two places every replica reads: its record in the metadata store, and its
work in the shard ledger (``work.postgres_ledger``), where the runners commit its lines. No
replica owns it, so no replica's death can leave it waiting. ``SharedBatches`` does what a call
needs:

- ``share(batch)``: the batch's lines admitted against the global intake and its record made. The
  ledger's work comes first, so a batch that does not fit (``IntakeFull``) records nothing; should
  the record then fail, the work is cancelled again (nothing runs for a batch nobody can see). The
  output file is recorded with it, so a client can read the lines committed so far.
- ``view(batch)``: the batch as it stands now: its request counts are the ledger's committed lines,
  each counted completed or failed by what it records (``requests.line_outcomes``, the rule one
  process counts by, wherever the line is kept), and its ``usage`` their tokens,
  and once the ledger says its work ended (every shard done, or cancelled) it is ended and saved
  so, ``completed`` (with an error file when there are error lines and they go apart, OpenAI's
  convention) or ``cancelled``. Whichever replica looks first saves the ending; every replica
  computes exactly the same record (the times are the ledger's ``ended_at``, on the database's
  clock, and the files' ids are made from the batch's), so a second save changes nothing and a
  client never sees an ended batch change. The ending's webhook event is saved in the outbox in
  the same write, with an id made from the batch's and its status, so the outbox keeps one
  message per target however many replicas save the ending (any replica's sender delivers it).
- ``cancel(batch)``: the work stopped on every replica (each runner drops the batch's shards within
  its watch interval) and the batch ended ``cancelled`` with the lines committed by then.
- ``end_due()``: the running batches past their completion window stopped the same way, and
  ended ``failed`` with ``batch_failed`` saying it timed out (the user guide), or ``expired``
  (OpenAI's convention), the lines committed by then kept. The ledger keeps why a batch was
  stopped (the first stop wins), so a cancel and an expiry at the same moment end it one way on
  every replica. It also saves the ending of every batch whose work ended since, so a batch
  nobody polls still ends on record, its webhook is sent, and its input file is free to delete
  or to run again.

A result file of a shared batch has no file of its own: its ``path`` names the batch's committed
segments of one kind (``segment_path``), which a reader reads through the segment store; once the
file is deleted, ``forget`` takes those segments out of the manifest and the store. They are read
in commit order, except once a batch with ``output_order: "input"`` has ended ``completed`` or
``cancelled`` (as the ledger says, so on every replica at the same moment, whether or not its
ending is saved yet): then in input order (``work.ordered_segments``), as a single process
rewrites such a batch's files; one that ran out of its window keeps commit order, as there. The
committed bytes never change, and the size is the same either way.
"""

from __future__ import annotations

import hashlib
import logging

import anyio
import attrs

from batchgen.core.batches.lifecycle import advance
from batchgen.core.batches.options import parse_completion_window
from batchgen.core.batches.output_order import INPUT
from batchgen.core.clock import exact_now, now, reached
from batchgen.core.files.content import SegmentContent
from batchgen.core.models import (
    OUTPUT_PURPOSE,
    Batch,
    BatchErrorInfo,
    BatchStatus,
    FileObject,
    RequestCounts,
    Usage,
)
from batchgen.core.storage import MetadataStore
from batchgen.core.storage.interfaces import IdempotencyRecord
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.webhook_outbox import WebhookTargets
from batchgen.core.work.intake import IntakeLimits
from batchgen.core.work.postgres_ledger import BatchWork, PostgresShardLedger
from batchgen.core.work.segment_store import SegmentStore
from batchgen.core.work.shards import ERRORS, OUTPUT, SHARD_LINES

__all__ = ["SEGMENTS_SCHEME", "SharedBatches", "event_id", "result_file_id", "segment_path", "segments_of"]

logger = logging.getLogger(__name__)

#: Why the ledger stopped a batch: a caller cancelled it, or its completion window ran out.
CANCELLED_BY_CALLER, EXPIRED_WINDOW = "cancelled", "expired"
#: How the ``path`` of a shared batch's result file begins: ``segments://BATCH/KIND``.
SEGMENTS_SCHEME = "segments://"


def segment_path(batch_id: str, kind: str) -> str:
    """The ``path`` of a shared batch's result file of ``kind`` (``OUTPUT`` or ``ERRORS``)."""
    return f"{SEGMENTS_SCHEME}{batch_id}/{kind}"


def segments_of(path: str) -> tuple[str, str] | None:
    """(batch id, kind) when ``path`` names a shared batch's segments, else None."""
    if not path.startswith(SEGMENTS_SCHEME):
        return None
    batch_id, _, kind = path.removeprefix(SEGMENTS_SCHEME).partition("/")
    return (batch_id, kind) if batch_id and kind in (OUTPUT, ERRORS) else None


def event_id(batch: Batch) -> str:
    """The id of a shared batch's terminal webhook event: the same on every replica that ends it."""
    return "evt_" + hashlib.sha256(f"{batch.id}/{batch.status.value}".encode()).hexdigest()[:24]


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a shared batch's result file: the same on every replica, and as hard to guess as
    the batch's own id (it is a hash of it)."""
    return "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]


class SharedBatches:
    """The batches replicas share, over one metadata store, one ledger and one segment store."""

    def __init__(
        self,
        metadata: MetadataStore,
        ledger: PostgresShardLedger,
        segments: SegmentStore,
        *,
        calls: MetadataCalls | None = None,
        limits: IntakeLimits | None = None,
        openai_convention: bool = False,
        shard_lines: int = SHARD_LINES,
        webhooks: WebhookTargets | None = None,
    ) -> None:
        """``openai_convention``: error lines go to an error file, and a batch past its window
        ends ``expired`` (OpenAI's Batch API); else the user guide's: with the output, ``failed``.
        ``webhooks``: where a batch's terminal event goes (saved in the outbox with the ending)."""
        self._webhooks = webhooks or WebhookTargets()
        self._metadata = metadata
        self._calls = calls or MetadataCalls(metadata)
        self._ledger = ledger
        self._segments = segments
        self._limits = limits
        self._openai_convention = openai_convention
        self._shard_lines = shard_lines

    async def share(
        self,
        batch: Batch,
        *,
        idempotency: IdempotencyRecord | None = None,
        limits: IntakeLimits | None = None,
        weight: float = 1.0,
        new_input: FileObject | None = None,
    ) -> Batch:
        """Admit a new batch (``validating``, its ``request_counts.total`` its lines) and record
        it ``in_progress`` with its output file (and ``idempotency``, its key, and a retry's
        ``new_input`` file, in the same step): ``IntakeFull`` when it does not fit now. ``limits``
        replace the ones given at start for this batch (its tenant's own); ``weight`` is its
        tenant's share weight in the claims."""
        lines = batch.request_counts.total
        await self._ledger.add_batch(
            batch.id,
            lines,
            self._shard_lines,
            tenant=batch.owner,
            limits=limits or self._limits,
            weight=weight,
        )
        output = self._result_file(batch, OUTPUT)
        started = attrs.evolve(advance(batch, BatchStatus.IN_PROGRESS, now=now()), output_file_id=output.id)
        files = (output,) if new_input is None else (new_input, output)
        try:  # the batch's row and its files' in one step: all or none
            await self._calls(self._metadata.insert_batch, started, idempotency=idempotency, files=files)
        except BaseException:
            try:
                await self._ledger.cancel(batch.id)
            except Exception:
                logger.exception(
                    "batch %s: its work could not be cancelled after its record failed", batch.id
                )
            raise
        return started

    async def view(self, batch: Batch) -> Batch:
        """The batch as it stands (see the module); a batch the ledger does not know is as recorded."""
        if batch.status.is_terminal:
            return batch
        work = await self._ledger.batch(batch.id)
        if work is None:
            return batch
        counts = RequestCounts(total=work.line_count, completed=work.completed, failed=work.failed)
        usage = Usage(
            work.prompt_tokens, work.completion_tokens, prefix_cached_tokens=work.prefix_cached_tokens
        )
        batch = attrs.evolve(batch, request_counts=counts, usage=usage)
        if work.status == "running" or work.ended_at is None:
            return batch
        ended = await self._ended(batch, work, work.ended_at)
        # its webhook event in the same write: the same event, id and body, from every replica
        outbox = self._webhooks.messages(ended, int(work.ended_at), event_id=event_id(ended))
        await self._calls(self._metadata.save_batch, ended, outbox=outbox)
        return ended

    async def cancel(self, batch: Batch) -> Batch:
        """Stop the batch's work everywhere and end it ``cancelled`` (a batch that ended already
        is returned as it ended)."""
        await self._ledger.cancel(batch.id, CANCELLED_BY_CALLER)
        return await self.view(batch)

    async def end_due(self) -> None:
        """Stop the running batches past their completion window, and save the ending of every
        batch whose work has ended but whose record does not say so yet (any replica may; see the
        module): an ending is saved, with its webhook event, whether or not anyone asks."""
        moment = exact_now()
        active = await self._calls(self._metadata.active_batches)
        for batch in active:
            if reached(batch.expires_at, moment):
                await self._ledger.cancel(batch.id, EXPIRED_WINDOW)
        ended = await self._ledger.stopped([batch.id for batch in active])
        for batch in active:
            if batch.id in ended:
                await self.view(batch)

    async def _ended(self, batch: Batch, work: BatchWork, ended_at: float) -> Batch:
        moment = int(ended_at)
        if self._openai_convention and work.failed:  # error lines apart, however the batch ended
            errors = self._result_file(batch, ERRORS)
            await self._record_once(errors)
            batch = attrs.evolve(batch, error_file_id=errors.id)
        if work.status == "cancelled" and work.stop_reason == EXPIRED_WINDOW:
            if self._openai_convention:
                return advance(batch, BatchStatus.EXPIRED, now=moment)
            message = (
                f"The batch timed out: it did not finish within its completion window of "
                f"{batch.completion_window} ({parse_completion_window(batch.completion_window)} s). "
                f"{work.completed + work.failed} of {work.line_count} requests finished "
                f"({work.completed} completed, {work.failed} failed); their lines are kept in the output file."
            )
            return advance(
                batch, BatchStatus.FAILED, now=moment, error=BatchErrorInfo("batch_failed", message)
            )
        if work.status == "cancelled":
            if batch.status is not BatchStatus.CANCELLING:
                batch = advance(batch, BatchStatus.CANCELLING, now=moment)
            return advance(batch, BatchStatus.CANCELLED, now=moment)
        return advance(advance(batch, BatchStatus.FINALIZING, now=moment), BatchStatus.COMPLETED, now=moment)

    async def _record_once(self, file: FileObject) -> None:
        """Record a result file unless another replica has already."""
        if await self._calls(self._metadata.get_file, file.id) is not None:
            return
        try:
            await self._calls(self._metadata.insert_file, file)
        except Exception:
            if await self._calls(self._metadata.get_file, file.id) is None:
                raise  # not a replica that recorded it first: a real failure

    def _result_file(self, batch: Batch, kind: str) -> FileObject:
        expires_at = None
        if batch.output_expires_after_s is not None:
            expires_at = batch.created_at + batch.output_expires_after_s
        return FileObject(
            id=result_file_id(batch.id, kind),
            bytes=0,
            created_at=batch.created_at,
            filename=f"{batch.id}_{'output' if kind == OUTPUT else 'error'}.jsonl",
            purpose=OUTPUT_PURPOSE,
            path=segment_path(batch.id, kind),
            expires_at=expires_at,
            owner=batch.owner,
        )

    async def content(self, file: FileObject) -> SegmentContent | None:
        """A shared batch's result file's committed bytes (a running batch's keep growing), in
        the order the module says; None for a file that is not one."""
        named = segments_of(file.path)
        if named is None:
            return None
        batch_id, kind = named
        # the ledger's state first: a batch seen ended commits nothing more, so the manifest
        # read after it is the whole of it
        in_input_order = await self._ended_in_input_order(batch_id)
        segments = await self._ledger.segments(batch_id, kind)
        return SegmentContent.of(self._segments, segments, in_input_order=in_input_order)

    async def _ended_in_input_order(self, batch_id: str) -> bool:
        """Whether the batch's result files read in input order now: it asked for that and its
        work ended by finishing or by a cancel (not by running out of its window)."""
        work = await self._ledger.batch(batch_id)
        if work is None or work.status == "running" or work.stop_reason == EXPIRED_WINDOW:
            return False
        batch = await self._calls(self._metadata.get_batch, batch_id)
        return batch is not None and batch.output_order == INPUT

    async def forget(self, file: FileObject) -> int:
        """After a shared batch's result file was deleted: its segments out of the manifest and
        out of the store (what this fails to delete, the orphan sweep collects); how many went.

        The file is deleted only once its batch has ended, so the segments of its kind that no
        commit lists (a fenced-out writer's, its commit refused) are never committed either:
        they go now too, not an orphan sweep later, so none of the file's bytes stay behind."""
        named = segments_of(file.path)
        if named is None:
            return 0
        keys = await self._ledger.forget_segments(*named)

        def collect() -> int:
            return self._segments.collect(sorted(set(keys) | set(self._segments.written(*named))))

        return await anyio.to_thread.run_sync(collect)

    async def sized(self, file: FileObject) -> FileObject:
        """The file with its size now: a shared batch's result file, as many bytes as are
        committed (in either order: the same lines); any other file as recorded."""
        named = segments_of(file.path)
        if named is None:
            return file
        return attrs.evolve(file, bytes=self._segments.size(await self._ledger.segments(*named)))
