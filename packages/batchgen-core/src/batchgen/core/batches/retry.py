"""Retrying what did not succeed: a new batch over exactly the lines of a batch still without a
success, linked both ways, and the merged view of a batch and its retries.

``BatchRetries.retry`` takes an ended batch and the outcomes to retry (``failed``: lines whose
best result so far is an error; ``not_run``: lines with no result at all, which a cancel or an
expiry dropped before they ran), judged over the batch's whole family (``result_merge``), so a
line a retry has already answered is not retried again. The selected lines of the batch's input
file are copied, as they are and in their order, into a new ``batch`` input file of the batch's
tenant, and a batch is created over it with ``retry_of`` naming the batch and the batch-level
parameters of the original unless the call gives others. An ``Idempotency-Key`` is fingerprinted
on the batch and the call (same key, same call: the same retry batch). The new input file's
record, the batch's row and the key are written in one transaction, so a crash leaves either a
whole retry batch (its input file, its row, its key) or none of them.

The retry batch and its input file are the batch's owner's, whoever asks (an admin too): they are
admitted against that tenant's limits, its ``max_active_batches`` and ``max_queued_requests`` as
any batch it creates, and its ``max_stored_bytes`` as any file it stores (the new file's bytes
are reserved before it is validated, and the reservation turns into its record with the batch's,
``files.stored_bytes_quota``).

Replicas sharing a store retry shared batches the same way: a family member's result files are
its committed segments, read into local copies that the index owns and deletes; the input file is
read through this replica's copy of it (an object store's); the new input file is put in the blob
store before its record is made with the batch's; and retries are made one at a time across the
replicas as well as within each (a lock every replica sees, ``SharedLocks``), so two replicas never
both retry the same lines.

Refused: a batch that has not ended, or one of whose retries has not (409 ``batch_not_final``);
one with nothing of the asked outcomes left (409 ``nothing_to_retry``); one whose input file, or
a family member's result file, is gone (409 ``results_missing``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from batchgen.core.batches.result_merge import FamilyIndex, Outcome
from batchgen.core.errors import Conflict, InvalidRequest, ServiceUnavailable
from batchgen.core.files.batch_file import validate_batch_file
from batchgen.core.files.content import FileContent
from batchgen.core.files.stored_bytes_quota import Reservation
from batchgen.core.idempotency import fingerprint
from batchgen.core.ids import new_object_id
from batchgen.core.models import Batch, BatchParameters, FileObject
from batchgen.core.storage.faults import storage_faults_as_errors
from batchgen.core.storage.interfaces import SharedLocks
from batchgen.core.tenancy import EMBEDDED, Caller

if TYPE_CHECKING:
    from batchgen.core.service import BatchService

__all__ = ["OUTCOMES", "BatchRetries", "RetryRequest", "with_retries"]

#: The lock every replica sharing a store takes to make a retry, how long one waits for it, and
#: how often it asks.
RETRIES_LOCK = "batchgen:retries"
SHARED_TURN_WAIT_S = 30.0
SHARED_TURN_POLL_S = 0.05
#: The outcomes a retry may ask for, by their API names.
OUTCOMES: dict[str, Outcome] = {"failed": Outcome.FAILED, "not_run": Outcome.NOT_RUN}
#: The batch-level fields a retry may set; those it leaves out are the original batch's.
OVERRIDABLE = (
    "completion_window",
    "metadata",
    "output_expires_after_s",
    "max_decoding_length",
    "temperature",
    "top_p",
    "top_k",
    "output_order",
)


def _conflict(message: str, code: str) -> Conflict:
    error = Conflict(message)
    error.code = code
    return error


@attrs.frozen
class RetryRequest:
    """What to retry and with which batch-level parameters (``overrides``: only those given)."""

    outcomes: frozenset[str] = frozenset(OUTCOMES)
    overrides: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if not self.outcomes:
            raise InvalidRequest("outcomes must name at least one of: failed, not_run", param="outcomes")
        unknown = sorted(set(self.outcomes) - set(OUTCOMES))
        if unknown:
            raise InvalidRequest(
                f"outcomes may hold 'failed' and 'not_run', got {unknown[0]!r}", param="outcomes"
            )
        extra = sorted(set(self.overrides) - set(OVERRIDABLE))
        if extra:
            raise InvalidRequest(f"A retry cannot set {extra[0]!r}", param=extra[0])

    def fingerprint(self, batch_id: str) -> str:
        return fingerprint("retry", batch_id, sorted(self.outcomes), self.overrides)


async def with_retries(service: BatchService, batches: Sequence[Batch]) -> list[Batch]:
    """The batches with ``retries`` filled in: only an ended batch can have any, and it is read
    from the store anyway, so a running batch's poll stays answered from memory."""
    ended = [batch.id for batch in batches if batch.status.is_terminal]
    if not ended:
        return list(batches)
    found = await service.parts.calls(service.metadata.retries_of, ended)
    return [attrs.evolve(batch, retries=found[batch.id]) if batch.id in found else batch for batch in batches]


class BatchRetries:
    """The retries of one service's batches, made one at a time (so two calls with one key, or
    two retries of one batch, cannot both make a batch)."""

    def __init__(self, service: BatchService) -> None:
        self._service = service
        self._lock = anyio.Lock()

    async def family(self, batch_id: str, caller: Caller = EMBEDDED) -> list[Batch]:
        """The batch (NotFound unless the caller sees it) and its retries, recursively, oldest first."""
        service = self._service
        root = await service.get_batch(batch_id, caller=caller)
        members = [root]
        for member_id in await service.parts.calls(service.metadata.retry_family, root.id):
            if member_id != root.id:
                members.append(await service.get_batch(member_id))
        return members

    async def index(self, batch_id: str, caller: Caller = EMBEDDED) -> tuple[list[Batch], FamilyIndex]:
        """The family of ``batch_id`` and its index (the caller closes it)."""
        members, index, _input = await self._indexed(batch_id, caller)
        return members, index

    async def _indexed(
        self, batch_id: str, caller: Caller, members: list[Batch] | None = None
    ) -> tuple[list[Batch], FamilyIndex, Path]:
        """The family of ``batch_id`` (``members`` when the caller has read it), its index, and
        a local path to the batch's input file.

        A shared batch's result files are held in committed segments, read into local copies
        that the index owns (``FamilyIndex``'s scratch files); an input file kept in an object
        store is read through this replica's copy of it (``BlobStore.readable``)."""
        service = self._service
        if members is None:
            members = await self.family(batch_id, caller)
        root = members[0]
        calls = service.parts.calls
        input_file = await calls(service.metadata.get_file, root.input_file_id)
        input_path = None if input_file is None else await self._readable(input_file)
        if input_path is None:
            raise _conflict(
                f"The input file '{root.input_file_id}' of batch '{root.id}' was deleted, so its "
                "results cannot be matched to its requests.",
                "results_missing",
            )
        result_files: list[Path] = []
        copies: list[Path] = []
        try:
            for member in members:
                for file_id, path in (
                    (member.output_file_id, service.blobs.output_path(member.id)),
                    (member.error_file_id, service.blobs.error_path(member.id)),
                ):
                    if file_id is None:
                        continue
                    if await calls(service.metadata.get_file, file_id) is None:
                        raise _conflict(
                            f"The result file '{file_id}' of batch '{member.id}' was deleted or has "
                            "expired, so the results it held are gone.",
                            "results_missing",
                        )
                    if service.replica is not None:  # committed segments: read into a local copy
                        path = self._new_copy_path(copies)
                        await _copy_content(await service.file_bytes(file_id), path)
                    result_files.append(path)
            staging = service.blobs.new_staging_path()
            index = await anyio.to_thread.run_sync(
                FamilyIndex.build, staging, input_path, result_files, copies
            )
        except BaseException:
            _delete(copies)
            raise
        return members, index, input_path

    def _new_copy_path(self, copies: list[Path]) -> Path:
        copies.append(self._service.blobs.new_staging_path())
        return copies[-1]

    async def _readable(self, file: FileObject) -> Path | None:
        """A local path holding the stored file's bytes (fetched from an object store when this
        replica has no copy), or None when they are gone."""
        with storage_faults_as_errors("read the input file"):
            try:
                return Path(await anyio.to_thread.run_sync(self._service.blobs.readable, file.path))
            except FileNotFoundError:
                return None

    async def retry(
        self,
        batch_id: str,
        request: RetryRequest,
        *,
        idempotency_key: str | None = None,
        caller: Caller = EMBEDDED,
    ) -> Batch:
        """A new batch over the lines of ``batch_id`` whose outcome so far is one of
        ``request.outcomes`` (see the module's docstring)."""
        async with self._lock, self._every_replicas_turn():
            return await self._retry(batch_id, request, idempotency_key, caller)

    @contextlib.asynccontextmanager
    async def _every_replicas_turn(self) -> AsyncIterator[None]:
        """With a store replicas share, their retries are made one at a time too: this waits
        (up to ``SHARED_TURN_WAIT_S``, then ServiceUnavailable) for the lock they all see."""
        store, calls = self._service.metadata, self._service.parts.calls
        if not isinstance(store, SharedLocks):
            yield
            return
        deadline = time.monotonic() + SHARED_TURN_WAIT_S
        while (release := await calls(store.try_lock, RETRIES_LOCK)) is None:
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(
                    "Another replica has been making a retry for too long; try again.", retry_after_s=1
                )
            await anyio.sleep(SHARED_TURN_POLL_S)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(release)

    async def _retry(
        self, batch_id: str, request: RetryRequest, idempotency_key: str | None, caller: Caller
    ) -> Batch:
        service = self._service
        call = request.fingerprint(batch_id)
        if idempotency_key is not None:
            earlier = await service.parts.ledger.replay(idempotency_key, "batch", call, caller.tenant)
            if earlier is not None:
                return await service.get_batch(earlier, caller=caller)
        original = await service.get_batch(batch_id, caller=caller)
        if not original.status.is_terminal:
            raise _conflict(
                f"Batch '{batch_id}' is {original.status.value}; only a batch that has ended "
                "(completed, failed, expired or cancelled) can be retried.",
                "batch_not_final",
            )
        # a retry still running refuses the call before any result is read: the calls waiting
        # for the lock (on every replica) are answered at once, not one index build each
        members = await self.family(batch_id, caller)
        running = [member for member in members[1:] if not member.status.is_terminal]
        if running:
            raise _conflict(
                f"Batch '{running[0].id}', a retry of '{batch_id}', is {running[0].status.value}; "
                "retry again once it has ended.",
                "batch_not_final",
            )
        members, index, input_path = await self._indexed(batch_id, caller, members)
        with index:
            wanted = frozenset(OUTCOMES[name] for name in request.outcomes)
            counts = index.counts()
            selected = sum(counts[outcome] for outcome in wanted)
            if selected == 0:
                raise _conflict(
                    f"Nothing to retry in batch '{batch_id}': of its {sum(counts.values())} requests, "
                    f"{counts[Outcome.SUCCEEDED]} succeeded, {counts[Outcome.FAILED]} failed and "
                    f"{counts[Outcome.NOT_RUN]} never ran, and the retry asks for "
                    f"{' and '.join(sorted(request.outcomes))}.",
                    "nothing_to_retry",
                )
            staging = service.blobs.new_staging_path()
            try:
                await anyio.to_thread.run_sync(_copy_lines, input_path, index.input_spans(wanted), staging)
            except BaseException:
                service.blobs.remove(staging)
                raise
        owner = service.caller_as_owner(caller, original.owner)
        reservation = await self._reserve(staging, owner)
        try:
            return await self._create(
                original, request, staging, owner, reservation, idempotency_key=idempotency_key, call=call
            )
        finally:
            reservation.release()

    async def _reserve(self, staging: Path, owner: Caller) -> Reservation:
        """The bytes of the new input file at ``staging``, held for its owner (UploadQuotaExceeded,
        and the copy deleted, when they would pass its ``max_stored_bytes``). Replicas check them
        here (their records have the last word on uploads, not on a retry's file)."""
        service = self._service
        limit = owner.limits.max_stored_bytes
        try:
            size = staging.stat().st_size
            if service.replica is not None:
                await service.parts.uploads.check_quota(owner, size)
                return Reservation(None, owner.tenant, size)
            return await service.parts.files.quota.reserve(owner.tenant, limit, size)
        except BaseException:
            service.blobs.remove(staging)
            raise

    async def _create(
        self,
        original: Batch,
        request: RetryRequest,
        staging: Path,
        owner: Caller,
        reservation: Reservation,
        *,
        idempotency_key: str | None,
        call: str,
    ) -> Batch:
        """The retry batch over the lines copied to ``staging``, made as ``owner``, its input file's
        record written as its ``reservation`` ends."""
        service = self._service
        new_input = await self._placed_input(staging, f"{original.id}_retry.jsonl", owner)
        settings = _settings_of(original) | request.overrides
        try:
            return await reservation.record(
                lambda: service.create_batch(
                    new_input.id,
                    original.endpoint,
                    completion_window=settings["completion_window"],
                    metadata=settings["metadata"],
                    parameters=BatchParameters(
                        max_decoding_length=settings["max_decoding_length"],
                        temperature=settings["temperature"],
                        top_p=settings["top_p"],
                        top_k=settings["top_k"],
                    ),
                    output_expires_after_s=settings["output_expires_after_s"],
                    idempotency_key=idempotency_key,
                    caller=owner,
                    retry_of=original.id,
                    output_order=settings["output_order"],
                    idempotency_call=call,
                    new_input=new_input,
                )
            )
        except BaseException:
            with anyio.CancelScope(shield=True):  # a cancelled call cleans up too
                # no batch was made: nor its input
                if await service.parts.calls(service.metadata.get_file, new_input.id) is None:
                    await anyio.to_thread.run_sync(service.blobs.remove, new_input.path)
            raise

    async def _placed_input(self, staging: Path, filename: str, owner: Caller) -> FileObject:
        """The retry's input file, checked as an upload is (the served models may have changed)
        and moved into place, but not recorded: ``create_batch`` records it with the batch."""
        service = self._service
        try:
            summary = await anyio.to_thread.run_sync(validate_batch_file, str(staging), service.model_set)
            file_id = new_object_id("file-")
            path = service.blobs.upload_path(file_id)
            os.replace(staging, path)
        except BaseException:
            service.blobs.remove(staging)
            raise
        try:  # every replica can read it before its record exists (an object store's put)
            with storage_faults_as_errors("store the retry's input file"):
                await anyio.to_thread.run_sync(service.blobs.publish, path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(service.blobs.remove, path)
            raise
        return service.parts.files.file_record(
            file_id=file_id,
            path=path,
            size=path.stat().st_size,
            filename=filename,
            purpose="batch",
            line_count=summary.line_count,
            url=summary.url,
            owner=owner.tenant,
        )


def _settings_of(batch: Batch) -> dict[str, Any]:
    """The batch-level fields of ``batch`` a retry takes unless it sets its own."""
    return {
        "completion_window": batch.completion_window,
        "metadata": batch.metadata,
        "output_expires_after_s": batch.output_expires_after_s,
        "output_order": batch.output_order,
        **batch.parameters.to_dict(),
    }


async def _copy_content(content: FileContent, target: Path) -> None:
    """Write all of ``content`` (a shared batch's committed segments) to ``target``."""
    async with await anyio.open_file(target, "wb") as writer:
        async for chunk in await content.open(0, content.size):
            await writer.write(chunk)


def _delete(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _copy_lines(source: Path, spans: Iterable[tuple[int, int]], target: Path) -> None:
    """Write the lines of ``source`` at ``spans`` (offset, length) to ``target``, in that order,
    each ending in a newline; the copy is synced before it is handed over."""
    with open(source, "rb") as reader, open(target, "wb") as writer:
        for offset, length in spans:
            line = os.pread(reader.fileno(), length, offset)
            writer.write(line if line.endswith(b"\n") else line + b"\n")
        writer.flush()
        os.fsync(writer.fileno())
