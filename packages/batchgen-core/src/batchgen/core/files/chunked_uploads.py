"""OpenAI's Uploads API: a file of many gigabytes received as parts, then made one file.

An upload is created with the file's name, purpose and size; parts (each at most
``MAX_PART_BYTES``, at most ``max_parts`` of them: ``--max-upload-parts``) arrive in any order, possibly at once; ``complete``
names the parts in the file's order (and may give the md5 of the whole file). Completing checks
the order and sizes and the md5, validates the bytes as a normal upload is validated (streamed over
the parts, bounded memory, lines numbered across part boundaries: ``streamed_validation``), and
only then assembles the file and records it: a normal file, usable for batches. An upload not
completed by its ``expires_at`` expires; a cancelled or expired upload's parts are deleted.

Each call that changes an upload holds its lock; expiry, whichever call notices it, waits while
another holds it: a complete started in time is never cut short by it. It completes (the file is
made) or it fails with the upload still pending, and expiry comes next. A cancel waits for the
complete too, and is then refused (the upload is completed) or cancels it.

On disk, under ``{storage}/uploads/{upload_id}/``: ``upload.json``, the upload's record (replaced
atomically on every change), and the parts, as ``upload_parts`` lays them out: received one after
another into one log, so that completing them in the order they arrived renames the log to be
the file and each byte is written once.

What each upload holds (its parts, their bytes, where its log ends) is kept as a running total
(``_PartTally``), counted from disk once at start and then at each change, and a tenant's pending
parts are counted in its stored bytes the same way (``stored_bytes_quota``): a part costs the same
however many parts came before it, of this upload or any other. A tenant may have at most
``max_open_uploads`` uploads open (pending or completing) at once (``--max-open-uploads``).

Completing is crash safe. Before assembling, the record turns ``completing`` with the part order,
their sizes, the new file's id and what validation found; assembly resumes from the record after a
restart. The file is served only once its metadata row exists, which is written after the
assembled file is in its place, so no half-made file is ever listed or served.

While parts arrive, they are validated in the order they arrived, in a worker thread
(``_Speculation``): when ``complete`` names that same order (the SDK sends parts one after another),
validation is then nearly done; otherwise it runs over the parts in the order named.

This is the single process's way of keeping uploads; replicas sharing a database keep them in it
(``shared_uploads``). Both take and refuse the same calls: the limits, records and checks are
``upload_rules``' (and re-exported here).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from batchgen.core.clock import now
from batchgen.core.errors import NotFound
from batchgen.core.files.batch_file import BatchFileSummary, LineRouter
from batchgen.core.files.catalogue import check_file_expiry
from batchgen.core.files.stored_bytes_quota import StoredBytesQuota
from batchgen.core.files.streamed_validation import (
    UTF8_BOM,
    BomStrip,
    Segment,
    StreamedValidation,
    segment_chunks,
)
from batchgen.core.files.upload_parts import PartDestination, PartFolder
from batchgen.core.files.upload_rules import (
    DEFAULT_MAX_OPEN_UPLOADS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_UPLOAD_EXPIRY_S,
    ENDED_RECORD_KEEP_S,
    MAX_NAME_CHARS,
    MAX_PART_BYTES,
    MAX_PARTS,
    UPLOAD_ID,
    UploadQuotaExceeded,
    check_completing_order,
    check_md5,
    check_new_upload,
    check_order,
    check_part_room,
    require_pending,
    too_many_open_uploads,
    too_many_parts,
    validate_chunks,
)
from batchgen.core.files.upload_validation_worker import ValidationWorker
from batchgen.core.ids import new_object_id
from batchgen.core.models import (
    CANCELLED,
    COMPLETED,
    COMPLETING,
    EXPIRED,
    HOLDING_PARTS,
    PENDING,
    FileObject,
    Upload,
    UploadPart,
)
from batchgen.core.storage.local_blobs import move_file
from batchgen.core.tenancy import EMBEDDED, Caller

__all__ = [
    "DEFAULT_MAX_OPEN_UPLOADS",
    "DEFAULT_MAX_UPLOAD_BYTES",
    "DEFAULT_UPLOAD_EXPIRY_S",
    "MAX_NAME_CHARS",
    "MAX_PARTS",
    "MAX_PART_BYTES",
    "ChunkedUploads",
    "Upload",
    "UploadPart",
    "UploadQuotaExceeded",
]

logger = logging.getLogger("batchgen.uploads")

#: The smallest upload validated in a worker process as its parts arrive (``upload_validation_worker``);
#: a smaller one is validated in a thread of the server (starting a process would cost more).
WORKER_MIN_BYTES = 64 * 1024 * 1024
#: Seconds between scans for the records of uploads that ended ``ENDED_RECORD_KEEP_S`` ago.
PRUNE_INTERVAL_S = 3600
_DIGEST_BYTES = 1 << 24


class _Speculation:
    """Validation of the parts in the order they arrived, one after another in a worker thread."""

    def __init__(self, served_models: Collection[str] | LineRouter | None) -> None:
        self.order: list[str] = []
        self._validation = StreamedValidation(served_models)
        self._queue: list[Segment] = []
        self._wake = threading.Condition()
        self._closed = False
        self.broken = False
        self._bom = BomStrip()
        self._thread = threading.Thread(target=self._run, name="upload validation", daemon=True)
        self._thread.start()

    def push(self, part_id: str, segment: Segment) -> None:
        with self._wake:
            self.order.append(part_id)
            self._queue.append(segment)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                segment = self._queue.pop(0)
            if self.broken:
                continue
            try:
                for chunk in segment_chunks([segment], forget=True):
                    self._validation.feed(self._bom.feed(chunk))
            except Exception:  # a part deleted meanwhile (cancel), a read error: validate at complete
                self.broken = True

    def result(self) -> BatchFileSummary | set[int] | None:
        """Wait for the parts pushed; what validation found (None: it could not run)."""
        self.close()
        self._thread.join()
        if self.broken:
            return None
        self._validation.feed(self._bom.finish())
        return self._validation.finish()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()


@attrs.define
class _PartTally:
    """What an upload holding parts holds: how many parts, their bytes, and where the parts in its
    log end (where the next part received into the log begins)."""

    owner: str
    parts: int = 0
    bytes: int = 0
    log_end: int = 0

    @classmethod
    def counted(cls, owner: str, folder: PartFolder) -> _PartTally:
        """The tally of the parts on disk (once, at start)."""
        tally = cls(owner)
        for part in folder.parts().values():
            tally.parts += 1
            tally.bytes += part.length
        tally.log_end = max((part.offset + part.length for part in folder.log_parts().values()), default=0)
        return tally

    def add(self, destination: PartDestination, size: int) -> None:
        self.parts += 1
        self.bytes += size
        if destination.offset is not None:
            self.log_end = destination.offset + size


def _write_json(path: Path, record: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as stream:
        json.dump(record, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


class ChunkedUploads:
    """Uploads and their parts under ``root``; files are made through ``register_file``."""

    def __init__(
        self,
        root: Path,
        *,
        max_upload_bytes: int,
        expiry_s: int,
        served_models: Collection[str] | LineRouter | None,
        register_file: Callable[[FileObject], Awaitable[None]],
        file_record: Callable[[str], Awaitable[FileObject | None]],
        new_file: Callable[..., FileObject],
        final_path: Callable[[str], Path],
        quota: StoredBytesQuota,
        max_parts: int = MAX_PARTS,
        max_open_uploads: int | None = DEFAULT_MAX_OPEN_UPLOADS,
    ) -> None:
        """``register_file`` records a new file; ``file_record(id)`` reads one; ``new_file`` makes
        the record of a file (``FileCatalogue.file_record``); ``final_path(file_id)`` is where a
        file's bytes live; ``quota`` admits the bytes of parts against the tenants' stored bytes.
        The three that reach the metadata store are awaited (``FileCatalogue`` makes them through
        its calls). ``max_parts``: the most parts of one upload; ``max_open_uploads``: the most
        uploads one tenant may have open (None: no limit)."""
        self.root = root
        self.max_upload_bytes = max_upload_bytes
        self.expiry_s = expiry_s
        self.max_parts = max_parts
        self.max_open_uploads = max_open_uploads
        self._served_models = served_models
        self._register_file = register_file
        self._file_record = file_record
        self._new_file = new_file
        self._final_path = final_path
        self._quota = quota
        self._tallies: dict[str, _PartTally] = {}  # uploads holding parts (pending or completing)
        self._open: dict[str, int] = {}  # uploads holding parts per tenant
        self._locks: dict[str, anyio.Lock] = {}
        self._speculations: dict[str, ValidationWorker | _Speculation] = {}
        self._receiving: dict[str, int] = {}  # parts being received per upload
        self._log_writers: set[str] = set()  # uploads with a part arriving into their log
        self._completing: set[str] = set()  # uploads being completed (a new part gets a file of its own)
        #: The pending uploads and when each expires (``expire_due`` reads no record until then).
        self._pending_expiry: dict[str, int] = {}
        self._next_prune = 0
        root.mkdir(parents=True, exist_ok=True)

    # --- records ---------------------------------------------------------------------------
    def _folder(self, upload_id: str) -> Path:
        return self.root / upload_id

    def _parts_of(self, upload_id: str) -> PartFolder:
        return PartFolder(self._folder(upload_id))

    def _save(self, upload: Upload) -> None:
        _write_json(self._folder(upload.id) / "upload.json", attrs.asdict(upload))

    def _load(self, upload_id: str) -> Upload | None:
        if UPLOAD_ID.match(upload_id) is None:
            return None
        try:
            record = json.loads((self._folder(upload_id) / "upload.json").read_text())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        return Upload(**record)

    async def get(self, upload_id: str, caller: Caller = EMBEDDED) -> Upload:
        """The upload as it stands (expired once past its ``expires_at``, unless a call is at work
        on it: see ``_current``); NotFound if the caller may not see it."""
        return self._current(upload_id, caller, holding_lock=False)

    def _current(self, upload_id: str, caller: Caller, *, holding_lock: bool) -> Upload:
        """The upload as it stands; a pending one past its ``expires_at`` is expired (its parts
        deleted) here, but only by a caller ``holding_lock`` (the upload's), or while no call
        holds it: a complete at work holds it, and its parts are not pulled out from under it
        (it completes, or expiry waits until it is done)."""
        upload = self._load(upload_id)
        if upload is None or not caller.sees(upload.owner):
            raise NotFound(f"No upload with id '{upload_id}'.")
        if upload.status == PENDING and upload.expires_at <= now():
            lock = self._locks.get(upload_id)
            if holding_lock or lock is None or not lock.locked():
                upload = self._end(upload, EXPIRED)
        return upload

    def _lock(self, upload_id: str) -> anyio.Lock:
        return self._locks.setdefault(upload_id, anyio.Lock())

    def parts(self, upload_id: str) -> dict[str, int]:
        """The parts received whole: id -> bytes."""
        return {part_id: segment.length for part_id, segment in self._parts_of(upload_id).parts().items()}

    def uploads(self) -> Iterator[Upload]:
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                upload = self._load(entry.name)
                if upload is not None:
                    yield upload

    def _tally(self, upload: Upload) -> _PartTally:
        """The running tally of an upload holding parts (counted from disk the first time: at start)."""
        tally = self._tallies.get(upload.id)
        if tally is None:
            tally = _PartTally.counted(upload.owner, self._parts_of(upload.id))
            self._tallies[upload.id] = tally
            self._open[upload.owner] = self._open.get(upload.owner, 0) + 1
            self._quota.add_pending(upload.owner, tally.bytes)
        return tally

    def _untrack(self, upload_id: str) -> None:
        """Forget the tally of an upload that holds no parts any more (ended, or its file recorded):
        its tenant's pending bytes and open uploads go down."""
        tally = self._tallies.pop(upload_id, None)
        if tally is None:
            return
        self._quota.drop_pending(tally.owner, tally.bytes)
        left = self._open.get(tally.owner, 1) - 1
        if left:
            self._open[tally.owner] = left
        else:
            self._open.pop(tally.owner, None)

    def open_uploads(self, tenant: str) -> int:
        """How many uploads the tenant has open (pending or completing)."""
        return self._open.get(tenant, 0)

    async def check_quota(self, caller: Caller, adding: int) -> None:
        """Refuse ``adding`` bytes that would take the caller's tenant past its ``max_stored_bytes``
        now (a check only; a part is admitted with its record)."""
        await self._quota.check(caller.tenant, caller.limits.max_stored_bytes, adding)

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
        await self.check_quota(caller, size)
        open_now = self.open_uploads(caller.tenant)
        if self.max_open_uploads is not None and open_now >= self.max_open_uploads:
            raise too_many_open_uploads(caller.tenant, open_now, self.max_open_uploads)
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
        self._folder(upload.id).mkdir()
        try:
            self._save(upload)
        except BaseException:  # a full disk: no upload is left half made
            shutil.rmtree(self._folder(upload.id), ignore_errors=True)
            raise
        self._pending_expiry[upload.id] = upload.expires_at
        self._tally(upload)  # counted from here: no await since the check of open uploads
        return upload

    async def new_part(self, upload_id: str, caller: Caller = EMBEDDED) -> PartDestination:
        """Where to receive a new part of a pending upload (with the part's id): the end of the
        upload's log, unless another part is arriving there; then ``add_part`` or ``drop_part``."""
        upload = self._current(upload_id, caller, holding_lock=False)
        require_pending(upload, "parts can be added to")
        tally = self._tally(upload)
        if tally.parts + self._receiving.get(upload_id, 0) >= self.max_parts:
            raise too_many_parts(self.max_parts)
        into_log = upload_id not in self._log_writers and upload_id not in self._completing
        destination = self._parts_of(upload_id).destination(
            new_object_id("part_"), into_log=into_log, log_end=tally.log_end
        )
        self._receiving[upload_id] = self._receiving.get(upload_id, 0) + 1
        if into_log:
            self._log_writers.add(upload_id)
        return destination

    def drop_part(self, upload_id: str, destination: PartDestination) -> None:
        """Forget a part not added (receiving it failed, or it was refused): its bytes are deleted."""
        PartFolder.discard(destination)
        self._part_done(upload_id, destination)

    def _part_done(self, upload_id: str, destination: PartDestination) -> None:
        """Balances ``new_part`` once the part is added or dropped."""
        if destination.in_log:
            self._log_writers.discard(upload_id)
        count = self._receiving.get(upload_id, 1) - 1
        if count:
            self._receiving[upload_id] = count
        else:
            self._receiving.pop(upload_id, None)

    async def add_part(
        self, upload_id: str, destination: PartDestination, caller: Caller = EMBEDDED
    ) -> UploadPart:
        """Add the part received at ``destination`` (dropped instead if it is refused)."""
        part_id = destination.part_id
        added = False
        try:
            async with self._lock(upload_id):
                upload = self._current(upload_id, caller, holding_lock=True)
                require_pending(upload, "parts can be added to")
                size = destination.received_bytes()
                tally = self._tally(upload)
                check_part_room(upload, tally.bytes, size)
                limit = self._quota.limit_of(caller, upload.owner)
                async with self._quota.admit(upload.owner, limit, size):  # checked and counted at once
                    segment = self._parts_of(upload_id).commit(destination, size)
                    added = True
                    tally.add(destination, size)
                    self._quota.add_pending(upload.owner, size)
                created = now()
                if upload.purpose == "batch":
                    speculation = self._speculations.get(upload_id)
                    if speculation is None:
                        speculation = self._speculate(upload.bytes)
                        self._speculations[upload_id] = speculation
                    speculation.push(part_id, segment)
                return UploadPart(id=part_id, created_at=created, upload_id=upload_id, bytes=size)
        finally:
            if added:
                self._part_done(upload_id, destination)
            else:
                self.drop_part(upload_id, destination)

    def _speculate(self, size: int) -> ValidationWorker | _Speculation:
        """A worker process validating the parts as they arrive, else a thread (all workers busy)."""
        if size >= WORKER_MIN_BYTES:
            worker = ValidationWorker(self._served_models)
            if worker.running:
                return worker
        return _Speculation(self._served_models)

    async def cancel(self, upload_id: str, caller: Caller = EMBEDDED) -> Upload:
        async with self._lock(upload_id):
            upload = self._current(upload_id, caller, holding_lock=True)
            require_pending(upload, "you can cancel")
            return self._end(upload, CANCELLED)

    def _end(self, upload: Upload, status: str) -> Upload:
        """Cancel or expire a pending upload: the record says so, the parts are deleted. Called
        only with the upload's lock held, or while no call holds it (never under a complete)."""
        ended = attrs.evolve(upload, status=status, ended_at=now())
        self._save(ended)
        self._pending_expiry.pop(upload.id, None)
        self._drop_parts(upload.id)
        self._untrack(upload.id)
        return ended

    def _drop_parts(self, upload_id: str) -> None:
        speculation = self._speculations.pop(upload_id, None)
        if speculation is not None:
            speculation.close()
        self._parts_of(upload_id).drop()

    async def complete(
        self, upload_id: str, part_ids: Sequence[str], md5: str | None = None, caller: Caller = EMBEDDED
    ) -> tuple[Upload, FileObject]:
        async with self._lock(upload_id):
            self._completing.add(upload_id)
            try:
                return await self._complete(upload_id, part_ids, md5, caller)
            finally:
                self._completing.discard(upload_id)

    async def _complete(
        self, upload_id: str, part_ids: Sequence[str], md5: str | None, caller: Caller
    ) -> tuple[Upload, FileObject]:
        upload = self._current(upload_id, caller, holding_lock=True)
        if upload.status == COMPLETED and upload.file_id is not None:
            file = await self._file_record(upload.file_id)
            if file is not None and list(part_ids) == list(upload.order):
                return upload, file  # a repeated complete (a retry after a lost answer)
        if upload.status == COMPLETING:
            check_completing_order(upload, part_ids)
            return await self._finish(upload)
        require_pending(upload, "you can complete")
        sizes = check_order(upload, part_ids, self.parts(upload_id), self.max_parts)
        pieces = self._parts_of(upload_id).pieces(part_ids, sizes)
        if md5 is not None:
            await self._check_md5(pieces, md5)
        head = b""
        for chunk in segment_chunks(pieces, len(UTF8_BOM)):  # a mark may be cut across tiny parts
            head += chunk
            if len(head) >= len(UTF8_BOM):
                break
        skip_bom = head.startswith(UTF8_BOM)
        summary = BatchFileSummary(line_count=0, url="")
        if upload.purpose == "batch":
            summary = await self._validate(upload_id, list(part_ids), pieces, skip_bom)
        completing = attrs.evolve(
            upload,
            status=COMPLETING,
            order=tuple(part_ids),
            sizes=sizes,
            skip_bom=skip_bom,
            file_id=new_object_id("file-"),
            line_count=summary.line_count,
            url=summary.url or None,
        )
        self._save(completing)
        return await self._finish(completing)

    async def _check_md5(self, pieces: list[Segment], md5: str) -> None:
        def digest() -> str:
            value = hashlib.md5(usedforsecurity=False)
            for chunk in segment_chunks(pieces, _DIGEST_BYTES):
                value.update(chunk)
            return value.hexdigest()

        check_md5(await anyio.to_thread.run_sync(digest), md5)

    async def _validate(
        self, upload_id: str, part_ids: list[str], pieces: list[Segment], skip_bom: bool
    ) -> BatchFileSummary:
        speculation = self._speculations.pop(upload_id, None)
        found: BatchFileSummary | set[int] | None = None
        if speculation is not None:
            if speculation.order == part_ids:
                found = await anyio.to_thread.run_sync(speculation.result)
            else:
                speculation.close()

        def chunks() -> Iterator[bytes]:
            return segment_chunks(pieces, skip=len(UTF8_BOM) if skip_bom else 0)

        first_pass = found
        return await anyio.to_thread.run_sync(
            lambda: validate_chunks(chunks, self._served_models, first_pass)
        )

    async def _finish(self, upload: Upload) -> tuple[Upload, FileObject]:
        """Assemble a ``completing`` upload (resuming where it stopped), record its file, and mark
        it completed."""
        assert upload.file_id is not None
        file = await self._file_record(upload.file_id)
        if file is None:
            final = self._final_path(upload.file_id)
            if not final.exists():
                assembled = await anyio.to_thread.run_sync(self._assemble, upload)
                await anyio.to_thread.run_sync(move_file, assembled, final)
            file = self._new_file(
                file_id=upload.file_id,
                path=final,
                size=final.stat().st_size,
                filename=upload.filename,
                purpose=upload.purpose,
                line_count=upload.line_count,
                url=upload.url,
                owner=upload.owner,
                expires_after_s=upload.expires_after_s,
            )
            # the row counts the bytes from now on, the parts no more: in one step for the quota
            # (a failure leaves the bytes where they are: completing again, or the next start,
            # records them)
            async with self._quota.lock(upload.owner):
                await self._register_file(file)
                self._untrack(upload.id)
        self._untrack(upload.id)  # (a row recorded before a crash)
        completed = attrs.evolve(upload, status=COMPLETED, ended_at=now())
        self._save(completed)
        self._pending_expiry.pop(upload.id, None)
        self._drop_parts(upload.id)  # parts sent but not named (a part sent again by a retry)
        return completed, file

    def _assemble(self, upload: Upload) -> Path:
        """The parts in the order completed, made one file (a rename when they are the log as
        it arrived)."""
        return self._parts_of(upload.id).assemble(
            upload.order,
            upload.sizes,
            len(UTF8_BOM) if upload.skip_bom else 0,
            log_busy=upload.id in self._log_writers,
        )

    # --- maintenance -----------------------------------------------------------------------
    def expire_due(self) -> None:
        """Expire pending uploads past their ``expires_at`` (deleting their parts), and forget
        uploads that ended long ago."""
        moment = now()
        for upload_id, expires_at in list(self._pending_expiry.items()):
            if expires_at > moment or self._lock(upload_id).locked():
                continue
            upload = self._load(upload_id)
            if upload is not None and upload.status == PENDING:
                self._end(upload, EXPIRED)
            self._pending_expiry.pop(upload_id, None)
            self._locks.pop(upload_id, None)
        if moment >= self._next_prune:  # a scan of every record, once an hour
            self._next_prune = moment + PRUNE_INTERVAL_S
            for upload in list(self.uploads()):
                ended = upload.ended_at or moment
                if upload.status in (COMPLETED, CANCELLED, EXPIRED) and ended + ENDED_RECORD_KEEP_S <= moment:
                    shutil.rmtree(self._folder(upload.id), ignore_errors=True)
                    self._locks.pop(upload.id, None)

    async def recover(self) -> None:
        """At start: finish uploads a crash left ``completing``, and drop parts half received."""
        for upload in list(self.uploads()):
            if upload.status == PENDING:
                self._parts_of(upload.id).repair()
                self._pending_expiry[upload.id] = upload.expires_at
            if upload.status in HOLDING_PARTS:
                self._tally(upload)
            if upload.status == COMPLETING:
                try:
                    async with self._lock(upload.id):
                        await self._finish(upload)
                except Exception:  # a full disk, say: completing again retries
                    logger.exception("could not finish completing upload %s", upload.id)
