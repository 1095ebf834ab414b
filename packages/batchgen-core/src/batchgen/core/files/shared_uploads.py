"""OpenAI's Uploads API served by replicas that share a database and a blob store.

Any replica serves any call of an upload: create it on one, send its parts to others (in any
order, at once), complete, cancel or read it on any. The same calls are taken and refused with the
same errors as in a single process (``chunked_uploads``): both apply ``upload_rules``.

- **Records** are rows in PostgreSQL (``storage.postgres_uploads``): the upload, and one row per
  part stored. Every state change is a conditional UPDATE from the state it leaves, so exactly
  one replica turns an upload ``completing``, ``cancelled`` or ``expired``, and exactly one
  records its file.
- **A part** is received into this replica's staging folder, then put where every replica reads
  it (``storage.upload_part_blobs``: ``uploads/UPLOAD_ID/PART_ID`` in the shared folder or the
  object store), and only then recorded, in a transaction that holds the upload's row and checks
  it is still pending, has room for the part and has fewer than ``max_parts`` parts, and spends
  the tenant's ``max_stored_bytes`` under its lock. A part refused there is deleted again.
- **Completing** streams the parts named, in their order, into one file in staging (8 MiB at a
  time, whatever their size), its md5 computed on the way and a byte order mark left out, then
  validates it as a normal upload is validated (``validate_chunks``, bounded memory). Only then
  does the upload turn ``completing`` with the new file's id, the order and what validation found;
  the file is moved into its place, published as ``POST /v1/files`` publishes one (the object
  store's conditional put), and its row inserted in the same transaction that turns the upload
  ``completed``. Then its parts are deleted.
- **A crash or a race while completing** leaves the upload ``completing`` with its parts: the next
  ``complete`` naming the same parts, on any replica, assembles them again into the same file id
  and finishes (two replicas finishing at once write the same bytes, and only one records the
  row; the other answers with that file). No file is served before its row exists.
- **Cancel and expiry** turn a pending upload ``cancelled`` or ``expired`` and delete its parts;
  the maintenance job (``expire_pending``) expires uploads past their ``expires_at`` and, once an
  hour, deletes the parts an interrupted deletion left and forgets uploads ended
  ``ENDED_RECORD_KEEP_S`` ago.

Every call to the database or the store runs in a worker thread (``MetadataCalls``, or
``anyio.to_thread``), never on the event loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import attrs

from batchgen.core.clock import now
from batchgen.core.errors import InvalidRequest, NotFound
from batchgen.core.files.batch_file import BatchFileSummary, LineRouter
from batchgen.core.files.catalogue import check_file_expiry
from batchgen.core.files.streamed_validation import BomStrip, Segment, segment_chunks
from batchgen.core.files.upload_parts import PartDestination, PartFolder
from batchgen.core.files.upload_rules import (
    DEFAULT_MAX_OPEN_UPLOADS,
    ENDED_RECORD_KEEP_S,
    MAX_PARTS,
    UPLOAD_ID,
    check_completing_order,
    check_md5,
    check_new_upload,
    check_order,
    check_part_room,
    quota_exceeded,
    require_pending,
    too_many_open_uploads,
    too_many_parts,
    validate_chunks,
)
from batchgen.core.files.write_behind import open_write_behind
from batchgen.core.ids import new_object_id
from batchgen.core.models import (
    CANCELLED,
    COMPLETED,
    COMPLETING,
    EXPIRED,
    PENDING,
    FileObject,
    Upload,
    UploadPart,
)
from batchgen.core.storage.interfaces import BlobStore
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.storage.stored_bytes import OpenUploadsAtLimit, StoredBytesExceeded
from batchgen.core.storage.upload_part_blobs import PartBlobs
from batchgen.core.tenancy import EMBEDDED, Caller

if TYPE_CHECKING:
    from batchgen.core.storage.postgres_uploads import PostgresUploadRecords

__all__ = ["SharedUploads"]

logger = logging.getLogger("batchgen.uploads")

#: Seconds between scans for the records of uploads that ended ``ENDED_RECORD_KEEP_S`` ago.
PRUNE_INTERVAL_S = 3600
#: The most uploads one maintenance run expires, cleans or forgets of each kind.
MAINTENANCE_BATCH = 100


@attrs.frozen
class _Gathered:
    """The parts of an upload made one file: the md5 of the parts' bytes, and whether a byte
    order mark at their start was left out of the file."""

    md5: str
    skip_bom: bool


class SharedUploads:
    """Uploads kept in ``records`` (PostgreSQL) and ``part_blobs``, their files made in
    ``blobs`` (the service's blob store) and read through ``file_record``."""

    def __init__(
        self,
        records: PostgresUploadRecords,
        part_blobs: PartBlobs,
        blobs: BlobStore,
        calls: MetadataCalls,
        *,
        max_upload_bytes: int,
        expiry_s: int,
        served_models: Collection[str] | LineRouter | None,
        file_record: Callable[[str], Awaitable[FileObject | None]],
        new_file: Callable[..., FileObject],
        max_parts: int = MAX_PARTS,
        max_open_uploads: int | None = DEFAULT_MAX_OPEN_UPLOADS,
    ) -> None:
        """``file_record(id)`` reads a file's row; ``new_file`` makes the record of a file
        (``FileCatalogue.file_record``); ``calls`` makes the database calls in worker threads.
        ``max_parts``: the most parts of one upload; ``max_open_uploads``: the most uploads one
        tenant may have open, over every replica (None: no limit)."""
        self.max_parts = max_parts
        self.max_open_uploads = max_open_uploads
        self._records = records
        self._part_blobs = part_blobs
        self._blobs = blobs
        self._calls = calls
        self.max_upload_bytes = max_upload_bytes
        self.expiry_s = expiry_s
        self._served_models = served_models
        self._file_record = file_record
        self._new_file = new_file
        self._next_prune = 0

    # --- records ---------------------------------------------------------------------------
    async def _record(self, upload_id: str) -> Upload | None:
        if UPLOAD_ID.match(upload_id) is None:
            return None
        return await self._calls(self._records.get, upload_id)

    async def get(self, upload_id: str, caller: Caller = EMBEDDED) -> Upload:
        upload = await self._record(upload_id)
        if upload is None or not caller.sees(upload.owner):
            raise NotFound(f"No upload with id '{upload_id}'.")
        if upload.status == PENDING and upload.expires_at <= now():
            upload, _ = await self._end(upload, EXPIRED)
        return upload

    async def check_quota(self, caller: Caller, adding: int) -> None:
        """Refuse ``adding`` bytes that would take the tenant past its ``max_stored_bytes`` now
        (a check before the work: the records check it again where they spend it)."""
        limit = caller.limits.max_stored_bytes
        if limit is None:
            return
        used = await self._calls(self._records.stored_bytes, caller.tenant)
        if used + adding > limit:
            raise quota_exceeded(caller.tenant, used, adding, limit)

    # --- the API ---------------------------------------------------------------------------
    async def create(
        self,
        *,
        filename: str,
        purpose: str,
        size: int,
        mime_type: str,
        expires_after_s: int | None = None,
        caller: Caller = EMBEDDED,
    ) -> Upload:
        """A pending upload; ``expires_after_s``: the lifetime of the file it makes."""
        check_new_upload(
            filename=filename,
            purpose=purpose,
            size=size,
            mime_type=mime_type,
            max_upload_bytes=self.max_upload_bytes,
        )
        check_file_expiry(expires_after_s)
        created = now()
        upload = Upload(
            id=new_object_id("upload_"),
            bytes=size,
            created_at=created,
            expires_at=created + self.expiry_s,
            filename=filename,
            purpose=purpose,
            mime_type=mime_type,
            owner=caller.tenant,
            expires_after_s=expires_after_s,
        )
        try:
            await self._calls(
                self._records.insert,
                upload,
                max_stored_bytes=caller.limits.max_stored_bytes,
                max_open=self.max_open_uploads,
            )
        except StoredBytesExceeded as exceeded:
            raise quota_exceeded(caller.tenant, exceeded.used, exceeded.adding, exceeded.limit) from None
        except OpenUploadsAtLimit as at_limit:
            raise too_many_open_uploads(caller.tenant, at_limit.open_now, at_limit.limit) from None
        return upload

    async def new_part(self, upload_id: str, caller: Caller = EMBEDDED) -> PartDestination:
        """Where to receive a new part of a pending upload (a staging file of this replica), with
        the part's id; then ``add_part`` or ``drop_part``."""
        upload = await self.get(upload_id, caller)
        require_pending(upload, "parts can be added to")
        return PartDestination(new_object_id("part_"), self._blobs.new_staging_path())

    def drop_part(self, upload_id: str, destination: PartDestination) -> None:
        """Forget a part not added (receiving it failed, or it was refused): its bytes are deleted."""
        PartFolder.discard(destination)

    async def add_part(
        self, upload_id: str, destination: PartDestination, caller: Caller = EMBEDDED
    ) -> UploadPart:
        """Store the part received at ``destination`` where every replica reads it, then record it
        (see the module); a part refused is deleted."""
        part_id = destination.part_id
        limit = caller.limits.max_stored_bytes
        try:
            upload = await self.get(upload_id, caller)
            require_pending(upload, "parts can be added to")
            size = await anyio.to_thread.run_sync(destination.received_bytes)
            check_part_room(upload, 0, size)  # a part too large whatever came before: never stored
            await self.check_quota(caller, size)
            await anyio.to_thread.run_sync(self._part_blobs.put, upload_id, part_id, destination.path)
        except BaseException:
            self.drop_part(upload_id, destination)
            raise

        def check(locked: Upload, have: int, count: int) -> None:
            require_pending(locked, "parts can be added to")
            if count >= self.max_parts:
                raise too_many_parts(self.max_parts)
            check_part_room(locked, have, size)

        created = now()
        try:
            found = await self._calls(
                self._records.add_part, upload_id, part_id, size, created, check=check, max_stored_bytes=limit
            )
        except StoredBytesExceeded as exceeded:
            await self._delete_part(upload_id, part_id)
            raise quota_exceeded(caller.tenant, exceeded.used, exceeded.adding, exceeded.limit) from None
        except InvalidRequest:
            await self._delete_part(upload_id, part_id)
            raise
        # (any other failure, a lost answer to the commit say, leaves the bytes: a part recorded
        # must keep them; unrecorded, they go with the upload's parts when it ends)
        if not found:
            await self._delete_part(upload_id, part_id)
            raise NotFound(f"No upload with id '{upload_id}'.")
        return UploadPart(id=part_id, created_at=created, upload_id=upload_id, bytes=size)

    async def cancel(self, upload_id: str, caller: Caller = EMBEDDED) -> Upload:
        upload = await self.get(upload_id, caller)
        require_pending(upload, "you can cancel")
        ended, moved = await self._end(upload, CANCELLED)
        if not moved:  # another replica cancelled or completed it first
            require_pending(ended, "you can cancel")
        return ended

    async def complete(
        self, upload_id: str, part_ids: Sequence[str], md5: str | None = None, caller: Caller = EMBEDDED
    ) -> tuple[Upload, FileObject]:
        upload = await self.get(upload_id, caller)
        settled = await self._settled(upload, part_ids)
        if settled is not None:
            return settled
        sizes = check_order(
            upload, part_ids, await self._calls(self._records.parts, upload_id), self.max_parts
        )
        staging = self._blobs.new_staging_path()
        try:
            completing = await self._begin(upload, part_ids, sizes, md5, staging)
        except OSError:  # a part gone: another replica completed it meanwhile (or a storage fault)
            await self._remove(staging)
            latest = await self.get(upload_id, caller)
            if latest.status == PENDING:
                raise
            return await self._answer_as_it_stands(latest, part_ids)
        except BaseException:
            await self._remove(staging)
            raise
        if completing is None:  # another replica turned it completing first
            await self._remove(staging)
            return await self._answer_as_it_stands(await self.get(upload_id, caller), part_ids)
        assert completing.file_id is not None
        return await self._record_file(completing, self._blobs.upload_path(completing.file_id))

    async def _begin(
        self, upload: Upload, part_ids: Sequence[str], sizes: tuple[int, ...], md5: str | None, staging: Path
    ) -> Upload | None:
        """Gather the parts named into ``staging``, check their md5 and validate them, then turn
        the upload ``completing`` and move the file into its place: the upload completing, or None
        when another replica turned it first (the file left in staging)."""
        gathered = await anyio.to_thread.run_sync(self._gather, upload.id, part_ids, sizes, staging)
        if md5 is not None:
            check_md5(gathered.md5, md5)
        summary = BatchFileSummary(line_count=0, url="")
        if upload.purpose == "batch":
            summary = await anyio.to_thread.run_sync(self._validate, staging)
        file_id = new_object_id("file-")
        completing = attrs.evolve(
            upload,
            status=COMPLETING,
            order=tuple(part_ids),
            sizes=sizes,
            skip_bom=gathered.skip_bom,
            file_id=file_id,
            line_count=summary.line_count,
            url=summary.url or None,
        )
        if not await self._calls(self._records.begin_completing, completing):
            return None
        await anyio.to_thread.run_sync(os.replace, staging, self._blobs.upload_path(file_id))
        return completing

    async def _answer_as_it_stands(
        self, latest: Upload, part_ids: Sequence[str]
    ) -> tuple[Upload, FileObject]:
        """The answer to a complete that another replica overtook, from the upload as it is now."""
        settled = await self._settled(latest, part_ids)
        if settled is None:  # pending again cannot be: an upload never goes back
            raise InvalidRequest(f"Upload '{latest.id}' changed while it was being completed; try again")
        return settled

    # --- completing ------------------------------------------------------------------------
    async def _settled(self, upload: Upload, part_ids: Sequence[str]) -> tuple[Upload, FileObject] | None:
        """The answer to completing an upload completed (the same parts again: its file) or being
        completed (finished here); None for a pending one; an error for any other."""
        if upload.status == COMPLETED and upload.file_id is not None:
            file = await self._file_record(upload.file_id)
            if file is not None and list(part_ids) == list(upload.order):
                return upload, file  # a repeated complete (a retry after a lost answer)
        if upload.status == COMPLETING:
            check_completing_order(upload, part_ids)
            return await self._finish(upload)
        require_pending(upload, "you can complete")
        return None

    def _gather(self, upload_id: str, order: Sequence[str], sizes: Sequence[int], target: Path) -> _Gathered:
        """Write the parts ``order`` names into ``target``, a byte order mark at their start
        left out; the md5 of the parts' bytes."""
        digest = hashlib.md5(usedforsecurity=False)
        bom = BomStrip()
        with open_write_behind(target) as stream:
            for part_id, size in zip(order, sizes, strict=True):
                for chunk in self._part_blobs.chunks(upload_id, part_id, size):
                    digest.update(chunk)
                    stream.write(bom.feed(chunk))
            stream.write(bom.finish())
            stream.flush()
            os.fsync(stream.fileno())
        return _Gathered(digest.hexdigest(), bom.skipped > 0)

    def _validate(self, path: Path) -> BatchFileSummary:
        whole = [Segment(str(path), 0, path.stat().st_size)]

        def chunks() -> Iterator[bytes]:
            return segment_chunks(whole)

        return validate_chunks(chunks, self._served_models)

    async def _finish(self, upload: Upload) -> tuple[Upload, FileObject]:
        """Assemble a ``completing`` upload again (a complete cut short by a crash, or running on
        another replica now) and record its file."""
        assert upload.file_id is not None
        staging = self._blobs.new_staging_path()
        final = self._blobs.upload_path(upload.file_id)
        try:
            await anyio.to_thread.run_sync(self._gather, upload.id, upload.order, upload.sizes, staging)
            await anyio.to_thread.run_sync(os.replace, staging, final)
        except OSError as failure:  # the parts deleted meanwhile: another replica finished it?
            await self._remove(staging)
            return await self._finished_elsewhere(upload, failure)
        except BaseException:
            await self._remove(staging)
            raise
        return await self._record_file(upload, final)

    async def _record_file(self, upload: Upload, final: Path) -> tuple[Upload, FileObject]:
        """Publish the file assembled at ``final`` and record it with the upload ``completed``;
        then delete the parts."""
        assert upload.file_id is not None
        await anyio.to_thread.run_sync(self._blobs.publish, final)
        size = await anyio.to_thread.run_sync(lambda: final.stat().st_size)
        file = self._new_file(
            file_id=upload.file_id,
            path=final,
            size=size,
            filename=upload.filename,
            purpose=upload.purpose,
            line_count=upload.line_count,
            url=upload.url,
            owner=upload.owner,
            expires_after_s=upload.expires_after_s,
        )
        ended_at = now()
        if not await self._calls(self._records.complete, upload.id, file, ended_at):
            return await self._finished_elsewhere(upload)
        await self._drop_parts_quietly(upload.id)
        return attrs.evolve(upload, status=COMPLETED, ended_at=ended_at), file

    async def _finished_elsewhere(
        self, upload: Upload, failure: OSError | None = None
    ) -> tuple[Upload, FileObject]:
        """The upload as another replica completed it, with its file; else ``failure`` (what
        stopped this replica finishing it), or an error saying it could not be completed."""
        latest = await self._record(upload.id)
        if latest is not None and latest.status == COMPLETED and latest.file_id is not None:
            file = await self._file_record(latest.file_id)
            if file is not None:
                return latest, file
        if failure is not None:
            raise failure
        raise InvalidRequest(
            f"Upload '{upload.id}' could not be completed: its parts are gone (it is "
            f"{latest.status if latest is not None else 'gone'})",
            param="upload_id",
        )

    # --- ending ----------------------------------------------------------------------------
    async def _end(self, upload: Upload, status: str) -> tuple[Upload, bool]:
        """Cancel or expire a pending upload and delete its parts: the upload as it now stands,
        and whether this call ended it (False: another replica moved it first, as it left it)."""
        ended_at = now()
        if not await self._calls(self._records.end, upload.id, status, ended_at):
            latest = await self._record(upload.id)
            if latest is None:
                raise NotFound(f"No upload with id '{upload.id}'.")
            return latest, False
        await self._drop_parts_quietly(upload.id)
        return attrs.evolve(upload, status=status, ended_at=ended_at), True

    async def _drop_parts(self, upload_id: str) -> None:
        await anyio.to_thread.run_sync(self._part_blobs.delete_upload, upload_id)
        await self._calls(self._records.forget_parts, upload_id)

    async def _drop_parts_quietly(self, upload_id: str) -> None:
        """Delete an ended upload's parts; a failure is left to the maintenance job."""
        try:
            with anyio.CancelScope(shield=True):
                await self._drop_parts(upload_id)
        except Exception as exc:
            logger.warning("could not delete the parts of upload %s now (retried later): %s", upload_id, exc)

    async def _delete_part(self, upload_id: str, part_id: str) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._part_blobs.delete_part, upload_id, part_id)

    async def _remove(self, path: Path) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._blobs.remove, path)

    # --- maintenance -----------------------------------------------------------------------
    def expire_due(self) -> None:
        """Nothing here: expiry reaches the database, so it runs as its own maintenance job
        (``expire_pending``), off the event loop."""

    async def expire_pending(self) -> None:
        """Expire pending uploads past their ``expires_at`` (deleting their parts); once every
        ``PRUNE_INTERVAL_S``, also delete the parts of ended uploads an earlier deletion missed
        (a crash, the store unreachable), and forget uploads that ended long ago."""
        moment = now()
        for upload_id in await self._calls(self._records.due, moment, MAINTENANCE_BATCH):
            upload = await self._record(upload_id)
            if upload is not None and upload.status == PENDING:
                await self._end(upload, EXPIRED)
        if moment >= self._next_prune:
            for upload_id in await self._calls(self._records.ended_with_parts, MAINTENANCE_BATCH):
                await self._drop_parts(upload_id)
            old = await self._calls(
                self._records.ended_before, moment - ENDED_RECORD_KEEP_S, MAINTENANCE_BATCH
            )
            for upload_id in old:
                await anyio.to_thread.run_sync(self._part_blobs.delete_upload, upload_id)
            if old:
                await self._calls(self._records.forget, old)
            if len(old) < MAINTENANCE_BATCH:
                self._next_prune = moment + PRUNE_INTERVAL_S

    async def recover(self) -> None:
        """Nothing at start: a complete cut short by a crash is finished by the next complete call
        on any replica, and a part half received is in the staging folder, cleared at start."""
