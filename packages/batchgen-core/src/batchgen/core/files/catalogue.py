"""The file catalogue: uploaded files and batch result files, their records and their contents.

It validates and stores uploads (with idempotent retries), lists, retrieves and deletes files,
reports a growing output file's current size, registers result files for batches, and deletes
files past their expiry. Every file has an owner (the tenant that uploaded it, or the owner of the
batch whose result it is); a caller that may not see a file is told it does not exist.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import anyio
import attrs

from batchgen.core.clock import now
from batchgen.core.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from batchgen.core.files.batch_file import LineRouter, validate_batch_file
from batchgen.core.files.content import DiskContent
from batchgen.core.files.stored_bytes_quota import Reservation, StoredBytesQuota
from batchgen.core.files.upload_rules import quota_exceeded
from batchgen.core.idempotency import IdempotencyLedger, fingerprint
from batchgen.core.ids import new_object_id
from batchgen.core.models import OUTPUT_PURPOSE, UPLOAD_PURPOSES, Batch, FileObject
from batchgen.core.storage import BlobStore, MetadataStore
from batchgen.core.storage.faults import storage_faults_as_errors
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.storage.stored_bytes import QuotaCheckedFileInserts, StoredBytesExceeded
from batchgen.core.tenancy import EMBEDDED, Caller, TenantLimits

MAX_FILE_EXPIRY_S = 30 * 86400


def check_file_expiry(expires_after_s: int | None) -> None:
    """Refuse a file lifetime (OpenAI's ``expires_after`` seconds) outside 1 s to 30 days; what
    ``POST /v1/files`` and an upload of the Uploads API both apply."""
    if expires_after_s is not None and not 1 <= expires_after_s <= MAX_FILE_EXPIRY_S:
        raise InvalidRequest(
            f"expires_after seconds must be between 1 and {MAX_FILE_EXPIRY_S}", param="expires_after"
        )


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class FileCatalogue:
    """Files as the API sees them, kept in a metadata store and a blob store."""

    def __init__(
        self,
        metadata: MetadataStore,
        blobs: BlobStore,
        ledger: IdempotencyLedger,
        *,
        calls: MetadataCalls,
        max_upload_bytes: int,
        file_expiry_s: int | None,
        in_use: Callable[[Sequence[Batch]], Batch | None],
        served_models: Collection[str] | LineRouter | None = None,
        tenant_limits: Callable[[str], TenantLimits] = lambda _tenant: TenantLimits(),
    ) -> None:
        """``in_use(batches)``: of the batches that name a file, a live one that still needs it,
        or None. The API's calls reach the metadata store through ``calls``. ``tenant_limits(tenant)``:
        the limits set on a tenant, for bytes an admin stores for it (``quota``)."""
        self._metadata = metadata
        self._calls = calls
        self._blobs = blobs
        self._ledger = ledger
        self.max_upload_bytes = max_upload_bytes
        self._file_expiry_s = file_expiry_s
        self._in_use = in_use
        self._served_models = served_models
        #: Every byte a tenant stores in this process, admitted against its ``max_stored_bytes``.
        self.quota = StoredBytesQuota(self.stored_bytes, tenant_limits)

    # --- uploads ---------------------------------------------------------------------------
    def new_upload_path(self) -> Path:
        return self._blobs.new_staging_path()

    def discard_upload(self, staging_path: Path) -> None:
        self._blobs.remove(staging_path)

    async def create_file(
        self,
        content: bytes | str | os.PathLike[str],
        *,
        filename: str | None,
        purpose: str,
        caller: Caller = EMBEDDED,
    ) -> FileObject:
        staging = self.new_upload_path()
        try:
            if isinstance(content, bytes):
                staging.write_bytes(content)
                name = filename or "upload.jsonl"
            else:
                await anyio.to_thread.run_sync(shutil.copyfile, content, staging)
                name = filename or Path(content).name
        except BaseException:
            self._blobs.remove(staging)  # a half-written copy (a full disk) is not left behind
            raise
        return await self.add_file(
            staging,
            filename=name,
            purpose=purpose,
            caller=caller,
            max_stored_bytes=caller.limits.max_stored_bytes,
        )

    async def add_file(
        self,
        staging_path: Path,
        *,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
        idempotency_key: str | None = None,
        caller: Caller = EMBEDDED,
        max_stored_bytes: int | None = None,
    ) -> FileObject:
        """Validate an upload received into ``staging_path`` and store it as the caller's; the
        staging file is consumed. With ``max_stored_bytes``, a store shared by replicas records
        the file only within that limit of the caller's stored bytes, checked in the same step
        (``storage.stored_bytes``: UploadQuotaExceeded otherwise); a single process reserves the
        bytes before validating them and turns the reservation into the row in one step
        (``quota``: UploadQuotaExceeded, before any work, when they do not fit)."""
        reservation = Reservation(None, caller.tenant, 0)
        try:
            check_file_expiry(expires_after_s)
            call = ""
            if idempotency_key is not None:
                digest = await anyio.to_thread.run_sync(_file_digest, staging_path)
                call = fingerprint(digest, filename, purpose, expires_after_s)
                earlier = await self._ledger.replay(idempotency_key, "file", call, caller.tenant)
                if earlier is not None:
                    self._blobs.remove(staging_path)
                    return await self.get(earlier)
            if purpose not in UPLOAD_PURPOSES:
                raise InvalidRequest(
                    f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}",
                    param="purpose",
                )
            size = staging_path.stat().st_size
            if size > self.max_upload_bytes:
                raise PayloadTooLarge(
                    f"The file is {size} bytes; the limit is {self.max_upload_bytes} bytes."
                )
            shared_quota = isinstance(self._metadata, QuotaCheckedFileInserts)
            if not shared_quota:  # held from before the slow work to the row
                reservation = await self.quota.reserve(caller.tenant, max_stored_bytes, size)
            line_count, url = 0, None
            if purpose == "batch":
                summary = await anyio.to_thread.run_sync(
                    validate_batch_file, str(staging_path), self._served_models
                )
                line_count, url = summary.line_count, summary.url
            file_id = new_object_id("file-")
            path = self._blobs.upload_path(file_id)
            os.replace(staging_path, path)
        except BaseException:
            reservation.release()
            self._blobs.remove(staging_path)
            raise
        try:
            return await self._record_upload(
                path,
                reservation,
                file_id=file_id,
                size=size,
                filename=filename,
                purpose=purpose,
                line_count=line_count,
                url=url,
                expires_after_s=expires_after_s,
                idempotency_key=idempotency_key,
                call=call,
                caller=caller,
                max_stored_bytes=max_stored_bytes if shared_quota else None,
            )
        finally:
            reservation.release()

    async def _record_upload(
        self,
        path: Path,
        reservation: Reservation,
        *,
        file_id: str,
        size: int,
        filename: str,
        purpose: str,
        line_count: int,
        url: str | None,
        expires_after_s: int | None,
        idempotency_key: str | None,
        call: str,
        caller: Caller,
        max_stored_bytes: int | None,
    ) -> FileObject:
        """Record an upload validated and in place at ``path``: its row (and key) written as the
        ``reservation`` of its bytes ends, or, with ``max_stored_bytes``, by a store shared by
        replicas that checks the limit in the same step."""
        await self._publish(path)
        file = self.file_record(
            file_id=file_id,
            path=path,
            size=size,
            filename=filename,
            purpose=purpose,
            line_count=line_count,
            url=url,
            owner=caller.tenant,
            expires_after_s=expires_after_s,
        )
        created = file.created_at
        try:
            if idempotency_key is not None:
                # a twin upload with the same key may have finished while this one validated
                earlier = await self._ledger.replay(idempotency_key, "file", call, caller.tenant)
                if earlier is not None:
                    self._blobs.remove(path)
                    return await self.get(earlier)
            # the row and its key in one step: a failure (a full disk) records neither
            idempotency = self._ledger.entry(idempotency_key, "file", call, created, caller.tenant)
            if max_stored_bytes is not None and isinstance(self._metadata, QuotaCheckedFileInserts):
                try:
                    await self._calls(
                        self._metadata.insert_file_within_quota,
                        file,
                        max_stored_bytes=max_stored_bytes,
                        idempotency=idempotency,
                    )
                except StoredBytesExceeded as exceeded:
                    raise quota_exceeded(caller.tenant, exceeded.used, size, exceeded.limit) from None
            else:
                await reservation.record(
                    functools.partial(self._calls, self._metadata.insert_file, file, idempotency=idempotency)
                )
        except BaseException:
            await self._discard(path)  # no row points at it: an upload that fails leaves nothing
            raise
        return file

    async def _publish(self, path: Path) -> None:
        """Make a file in place at ``path`` readable by every replica (nothing to do unless its
        contents go to an object store); on a failure nothing of it is left."""
        try:
            with storage_faults_as_errors("store the file"):
                await anyio.to_thread.run_sync(self._blobs.publish, path)
        except BaseException:
            await self._discard(path)
            raise

    async def _discard(self, path: str | os.PathLike[str]) -> None:
        """Delete a stored file's contents (off the event loop: an object store is a network
        call away), even while the caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._blobs.remove, path)

    # --- records of stored files (uploads, the Uploads API's assembled files, retries' inputs) ---
    def file_record(
        self,
        *,
        file_id: str,
        path: Path,
        size: int,
        filename: str,
        purpose: str,
        line_count: int,
        url: str | None,
        owner: str,
        expires_after_s: int | None = None,
    ) -> FileObject:
        """The record of a file in place at ``path`` (validated already), not saved yet: created
        now, expiring ``expires_after_s`` (else the server's file lifetime) later."""
        created = now()
        lifetime = expires_after_s or self._file_expiry_s
        return FileObject(
            id=file_id,
            bytes=size,
            created_at=created,
            filename=filename,
            purpose=purpose,
            path=str(path),
            line_count=line_count,
            url=url,
            expires_at=None if lifetime is None else created + lifetime,
            owner=owner,
        )

    async def register(self, file: FileObject) -> None:
        """Record a file made elsewhere (the Uploads API's assembled file), in place at its path."""
        with storage_faults_as_errors("store the file"):
            await anyio.to_thread.run_sync(self._blobs.publish, Path(file.path))
        await self._calls(self._metadata.insert_file, file)

    async def file_of(self, file_id: str) -> FileObject | None:
        """The stored record of ``file_id`` (whoever owns it), or None."""
        return await self._calls(self._metadata.get_file, file_id)

    async def stored_bytes(self, owner: str) -> int:
        """The bytes of the files ``owner`` uploaded (batch results not counted)."""
        return await self._calls(self._stored_bytes, owner)

    def _stored_bytes(self, owner: str) -> int:
        total, after = 0, None
        while True:
            files, has_more = self._metadata.list_files(
                after=after, limit=10000, descending=False, purpose=None, owner=owner
            )
            total += sum(file.bytes for file in files if file.purpose != OUTPUT_PURPOSE)
            if not has_more or not files:
                return total
            after = files[-1].id

    # --- result files ----------------------------------------------------------------------
    def result_file(self, batch: Batch, path: Path, kind: str) -> FileObject:
        """The record of a batch's output or error file (its lines are appended as requests
        finish), not saved yet: ``BatchTracker.record_file`` saves it (later, while another
        process holds the database locked).

        It expires the batch's ``output_expires_after`` after now, else the server's
        ``file_expiry_s``, else never. It belongs to the batch's owner.
        """
        return self.file_record(
            file_id=new_object_id("file-"),
            path=path,
            size=0,
            filename=f"{batch.id}_{kind}.jsonl",
            purpose=OUTPUT_PURPOSE,
            line_count=0,
            url=None,
            owner=batch.owner,
            expires_after_s=batch.output_expires_after_s,
        )

    # --- reading and deleting --------------------------------------------------------------
    async def record(self, file_id: str, caller: Caller = EMBEDDED) -> FileObject:
        """The stored record, or NotFound (also when the caller may not see it)."""
        file = await self._calls(self._metadata.get_file, file_id)
        if file is None or not caller.sees(file.owner):
            raise NotFound(f"No file with id '{file_id}'.")
        return file

    async def get(self, file_id: str, caller: Caller = EMBEDDED) -> FileObject:
        """The file as the API shows it: a result file with its current size."""
        return self._with_live_size(await self.record(file_id, caller))

    async def list(
        self, *, after: str | None, limit: int, order: str, purpose: str | None, caller: Caller = EMBEDDED
    ) -> tuple[list[FileObject], bool]:
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
        if not 1 <= limit <= 10000:
            raise InvalidRequest("limit must be between 1 and 10000", param="limit")
        files, has_more = await self._calls(
            self._metadata.list_files,
            after=after,
            limit=limit,
            descending=order == "desc",
            purpose=purpose,
            owner=caller.owner_filter,
        )
        return [self._with_live_size(file) for file in files], has_more

    async def delete(self, file_id: str, caller: Caller = EMBEDDED) -> FileObject:
        """Delete the file's record and contents; the record it was."""
        file = await self.record(file_id, caller)
        user = self._in_use(await self._calls(self._metadata.batches_using_file, file_id))
        if user is not None:
            raise Conflict(
                f"File '{file_id}' is in use by batch '{user.id}' ({user.status.value}); "
                "cancel the batch or wait for it to end first."
            )
        await self._calls(self._metadata.delete_file, file_id)
        await self._discard(file.path)
        return file

    async def content(self, file_id: str, caller: Caller = EMBEDDED) -> DiskContent:
        """The file's bytes on disk, as many as there are now (an output file keeps growing)."""
        file = await self.get(file_id, caller)
        if file.purpose == OUTPUT_PURPOSE:  # a result file grows in place: it is never published
            return DiskContent(file.id, Path(file.path), file.bytes)
        with storage_faults_as_errors("read the file"):
            try:
                path = await anyio.to_thread.run_sync(self._blobs.readable, file.path)
            except FileNotFoundError:
                raise NotFound(f"The contents of file '{file_id}' are gone.") from None
        return DiskContent(file.id, path, file.bytes)

    async def delete_expired(self) -> None:
        """Delete files past their expiry that no live batch needs."""
        for file in await self._calls(self._metadata.expired_files, now()):
            if self._in_use(await self._calls(self._metadata.batches_using_file, file.id)) is None:
                await self._calls(self._metadata.delete_file, file.id)
                await self._discard(file.path)

    @staticmethod
    def _with_live_size(file: FileObject) -> FileObject:
        if file.purpose != OUTPUT_PURPOSE:
            return file
        try:
            size = os.stat(file.path).st_size
        except FileNotFoundError:
            size = 0
        return attrs.evolve(file, bytes=size)
