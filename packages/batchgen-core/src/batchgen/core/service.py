"""BatchService: the one facade over files, batches, pools, scheduler, storage and backend.

The REST server calls it, and a custom pipeline can embed it with no HTTP at all::

    async with BatchService(ServiceSettings(storage_path=path), backend) as service:
        file = await service.create_file(b'{"custom_id": ...}\\n', filename="in.jsonl")
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        batch = await service.wait_for_batch(batch.id)

It owns the batch lifecycle (validating → in_progress → finalizing → completed, and failed,
cancelling → cancelled), runs each admitted request on the backend, appends its result line the
moment it finishes, and on start resumes batches a previous run left unfinished.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import msgspec

from batchgen.core.backends.base import (
    Backend,
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
)
from batchgen.core.batch_file import index_batch_file, validate_batch_file
from batchgen.core.errors import (
    Conflict,
    IntakeFull,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
)
from batchgen.core.ids import new_object_id, new_request_id
from batchgen.core.intake import IntakeEntry, IntakePool
from batchgen.core.models import (
    OUTPUT_PURPOSE,
    SUPPORTED_ENDPOINTS,
    UPLOAD_PURPOSES,
    Batch,
    BatchErrorInfo,
    BatchParameters,
    BatchStatus,
    FileObject,
    GenerationRequest,
    Health,
    PoolStatus,
    RequestCounts,
    Usage,
)
from batchgen.core.parameters import ServerDefaults, resolve_sampling
from batchgen.core.results import error_line, output_line
from batchgen.core.scheduler import Scheduler
from batchgen.core.scheduling import SchedulingPool
from batchgen.core.storage import BlobStore, MetadataStore, OutputWriter, read_finished_lines

logger = logging.getLogger("batchgen.service")

_decode = msgspec.json.Decoder().decode
_WINDOW = re.compile(r"^([1-9][0-9]*)([smhd])$")
_WINDOW_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_METADATA_PAIRS = 16
MAX_FILE_EXPIRY_S = 30 * 86400


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(parts, order="sorted")).hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _now() -> int:
    return int(time.time())


@attrs.frozen
class ServiceSettings:
    """Everything the service needs besides its backend."""

    storage_path: Path = attrs.field(converter=Path)
    max_intake_capacity: int = 1_000_000
    max_pool_size: int = 10_240
    max_upload_bytes: int = 512 * 1024 * 1024
    default_max_tokens: int = 256
    max_request_attempts: int = 3
    counters_flush_interval_s: float = 0.5
    fsync_interval_ms: int = 1000
    shutdown_grace_s: float = 10.0
    file_expiry_s: int | None = None
    maintenance_interval_s: float = 0.5


@attrs.define(eq=False)
class _RunningBatch:
    """Live state of a batch the service is working on; ``snapshot`` is what callers see."""

    batch: Batch
    output: OutputWriter
    errors: OutputWriter
    input_fd: int | None = None
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: set[str] = attrs.Factory(set)
    dirty: bool = False

    def snapshot(self) -> Batch:
        return attrs.evolve(
            self.batch,
            request_counts=RequestCounts(self.batch.request_counts.total, self.completed, self.failed),
            usage=Usage(self.prompt_tokens, self.completion_tokens),
        )

    @property
    def finished(self) -> int:
        return self.completed + self.failed


def parse_completion_window(window: str) -> int:
    """Seconds in a completion window such as ``24h``; raise InvalidRequest otherwise."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    if match is None:
        raise InvalidRequest(
            f"completion_window must look like '24h' (a number and s, m, h or d), got {window!r}",
            param="completion_window",
        )
    return int(match.group(1)) * _WINDOW_SECONDS[match.group(2)]


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of string keys and values", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata may have at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise InvalidRequest(
                "metadata keys must be at most 64 characters and values strings of at most 512",
                param="metadata",
            )
    return dict(metadata)


def _check_parameters(parameters: BatchParameters) -> None:
    checks = (
        ("max_decoding_length", parameters.max_decoding_length, int, lambda v: v >= 1, "at least 1"),
        ("temperature", parameters.temperature, (int, float), lambda v: 0 <= v <= 2, "between 0 and 2"),
        ("top_p", parameters.top_p, (int, float), lambda v: 0 < v <= 1, "in (0, 1]"),
        ("top_k", parameters.top_k, int, lambda v: v == -1 or v >= 1, "-1 or at least 1"),
    )
    for name, value, kind, valid, expected in checks:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind) or not valid(value):
            raise InvalidRequest(f"{name} must be {expected}, got {value!r}", param=name)


class BatchService:
    """Files, batches and the machinery that runs them; use as an async context manager."""

    def __init__(self, settings: ServiceSettings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.blobs = BlobStore(settings.storage_path)
        self.intake = IntakePool(settings.max_intake_capacity)
        self.slots = SchedulingPool(settings.max_pool_size)
        self.scheduler = Scheduler(self.intake, self.slots, self._run_request)
        self._defaults = ServerDefaults(max_tokens=settings.default_max_tokens)
        self._metadata: MetadataStore | None = None
        self._running: dict[str, _RunningBatch] = {}
        self._tasks: anyio.abc.TaskGroup | None = None
        self._started_at = _now()

    # --- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> BatchService:
        self._metadata = MetadataStore(self.settings.storage_path / "metadata.sqlite3")
        self.blobs.clear_staging()
        try:
            await self.backend.start()
        except BaseException:
            self.metadata.close()  # a backend that cannot start leaves nothing open behind it
            self._metadata = None
            raise
        self._task_group = anyio.create_task_group()
        self._tasks = await self._task_group.__aenter__()
        await self._tasks.start(self.scheduler.run)
        self._tasks.start_soon(self._flush_counters_periodically)
        self._tasks.start_soon(self._sync_outputs_periodically)
        self._tasks.start_soon(self._expire_periodically)
        await self._recover()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop admitting, give running requests ``shutdown_grace_s`` to finish, persist, stop.

        Requests still running after the grace period are abandoned without a line; the next
        start queues them again.
        """
        assert self._tasks is not None
        self.scheduler.paused = True
        with anyio.move_on_after(self.settings.shutdown_grace_s):
            while self.slots.active:
                await anyio.sleep(0.02)
        if self.slots.active:
            logger.warning("shutting down with %d requests still running; they will rerun", self.slots.active)
        self._tasks.cancel_scope.cancel()
        with contextlib.suppress(BaseException):
            await self._task_group.__aexit__(None, None, None)
        self._tasks = None
        for running in list(self._running.values()):
            self._persist(running)
            self._close(running)
        self._running.clear()
        await self.backend.stop()
        self.metadata.close()

    @property
    def metadata(self) -> MetadataStore:
        if self._metadata is None:
            raise RuntimeError("BatchService is not started; use 'async with service:'")
        return self._metadata

    @property
    def tasks(self) -> anyio.abc.TaskGroup:
        if self._tasks is None:
            raise RuntimeError("BatchService is not started; use 'async with service:'")
        return self._tasks

    # --- files ----------------------------------------------------------------------------
    def new_upload_path(self) -> Path:
        """A staging path the caller may stream an upload into, then pass to ``add_file``."""
        return self.blobs.new_staging_path()

    async def create_file(
        self, content: bytes | str | os.PathLike[str], *, filename: str | None = None, purpose: str = "batch"
    ) -> FileObject:
        """Store a file given as bytes or as a path on disk (copied, not moved)."""
        staging = self.new_upload_path()
        if isinstance(content, bytes):
            staging.write_bytes(content)
            name = filename or "upload.jsonl"
        else:
            await anyio.to_thread.run_sync(shutil.copyfile, content, staging)
            name = filename or Path(content).name
        return await self.add_file(staging, filename=name, purpose=purpose)

    async def add_file(
        self,
        staging_path: Path,
        *,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
        idempotency_key: str | None = None,
    ) -> FileObject:
        """Validate a file received into ``staging_path`` and store it; the staging file is consumed.

        ``expires_after_s`` (else the server's ``file_expiry_s``) deletes the file that long after
        its creation. With ``idempotency_key``, the same upload again returns the first file.
        """
        try:
            if expires_after_s is not None and not 1 <= expires_after_s <= MAX_FILE_EXPIRY_S:
                raise InvalidRequest(
                    f"expires_after seconds must be between 1 and {MAX_FILE_EXPIRY_S}", param="expires_after"
                )
            fingerprint = ""
            if idempotency_key is not None:
                digest = await anyio.to_thread.run_sync(_file_digest, staging_path)
                fingerprint = _fingerprint(digest, filename, purpose, expires_after_s)
                earlier = self._replay(idempotency_key, "file", fingerprint)
                if earlier is not None:
                    self.blobs.remove(staging_path)
                    return await self.get_file(earlier)
            if purpose not in UPLOAD_PURPOSES:
                raise InvalidRequest(
                    f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}",
                    param="purpose",
                )
            size = staging_path.stat().st_size
            if size > self.settings.max_upload_bytes:
                raise PayloadTooLarge(
                    f"The file is {size} bytes; the limit is {self.settings.max_upload_bytes} bytes."
                )
            line_count, url = 0, None
            if purpose == "batch":
                summary = await anyio.to_thread.run_sync(validate_batch_file, str(staging_path))
                line_count, url = summary.line_count, summary.url
            file_id = new_object_id("file-")
            path = self.blobs.upload_path(file_id)
            os.replace(staging_path, path)
        except BaseException:
            self.blobs.remove(staging_path)
            raise
        now = _now()
        lifetime = expires_after_s or self.settings.file_expiry_s
        file = FileObject(
            id=file_id,
            bytes=size,
            created_at=now,
            filename=filename,
            purpose=purpose,
            path=str(path),
            line_count=line_count,
            url=url,
            expires_at=None if lifetime is None else now + lifetime,
        )
        if idempotency_key is not None:
            try:  # a twin upload with the same key may have finished while this one validated
                earlier = self._replay(idempotency_key, "file", fingerprint)
            except Conflict:
                self.blobs.remove(path)
                raise
            if earlier is not None:
                self.blobs.remove(path)
                return await self.get_file(earlier)
            self.metadata.put_idempotency_key(idempotency_key, "file", fingerprint, file.id, now)
        self.metadata.insert_file(file)
        return file

    def _replay(self, key: str, scope: str, fingerprint: str) -> str | None:
        """The id an earlier call with this idempotency key made, or None; Conflict on a mismatch."""
        recorded = self.metadata.get_idempotency_key(key)
        if recorded is None:
            return None
        recorded_scope, recorded_fingerprint, object_id = recorded
        if recorded_scope != scope or recorded_fingerprint != fingerprint:
            raise Conflict(
                f"Idempotency-Key '{key}' was already used with a different request; "
                "use a new key for a new request."
            )
        return object_id

    def _file_or_404(self, file_id: str) -> FileObject:
        file = self.metadata.get_file(file_id)
        if file is None:
            raise NotFound(f"No file with id '{file_id}'.")
        return file

    def _live_size(self, file: FileObject) -> FileObject:
        if file.purpose != OUTPUT_PURPOSE:
            return file
        try:
            size = os.stat(file.path).st_size
        except FileNotFoundError:
            size = 0
        return attrs.evolve(file, bytes=size)

    async def get_file(self, file_id: str) -> FileObject:
        return self._live_size(self._file_or_404(file_id))

    async def list_files(
        self, *, after: str | None = None, limit: int = 10000, order: str = "desc", purpose: str | None = None
    ) -> tuple[list[FileObject], bool]:
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
        if not 1 <= limit <= 10000:
            raise InvalidRequest("limit must be between 1 and 10000", param="limit")
        files, has_more = self.metadata.list_files(
            after=after, limit=limit, descending=order == "desc", purpose=purpose
        )
        return [self._live_size(file) for file in files], has_more

    async def delete_file(self, file_id: str) -> None:
        file = self._file_or_404(file_id)
        for batch in self.metadata.batches_using_file(file_id):
            if batch.id in self._running or batch.status.is_active:
                raise Conflict(
                    f"File '{file_id}' is in use by batch '{batch.id}' ({batch.status.value}); "
                    "cancel the batch or wait for it to end first."
                )
        self.metadata.delete_file(file_id)
        self.blobs.remove(file.path)

    async def file_content(self, file_id: str) -> tuple[Path, int]:
        """The file's path and how many bytes of it to read now (an output file keeps growing)."""
        file = self._live_size(self._file_or_404(file_id))
        return Path(file.path), file.bytes

    # --- batches --------------------------------------------------------------------------
    async def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        *,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        parameters: BatchParameters | None = None,
        idempotency_key: str | None = None,
    ) -> Batch:
        """Accept a batch over an uploaded ``batch`` file; it starts in the background.

        With ``idempotency_key``, a repeat of the same call returns the batch the first call
        created, and the same key with different arguments raises Conflict.
        """
        parameters = parameters or BatchParameters()
        fingerprint = _fingerprint(input_file_id, endpoint, completion_window, metadata, parameters.to_dict())
        if idempotency_key is not None:
            earlier = self._replay(idempotency_key, "batch", fingerprint)
            if earlier is not None:
                return await self.get_batch(earlier)
        if endpoint not in SUPPORTED_ENDPOINTS:
            raise InvalidRequest(
                f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}, got {endpoint!r}",
                param="endpoint",
            )
        window_s = parse_completion_window(completion_window)
        metadata = _check_metadata(metadata)
        _check_parameters(parameters)
        file = self.metadata.get_file(input_file_id) if isinstance(input_file_id, str) else None
        if file is None:
            raise InvalidRequest(f"No file with id '{input_file_id}'.", param="input_file_id")
        if file.purpose != "batch":
            raise InvalidRequest(
                f"File '{file.id}' has purpose '{file.purpose}'; a batch needs a 'batch' file.",
                param="input_file_id",
            )
        if file.url != endpoint:
            raise InvalidRequest(
                f"The file's requests use '{file.url}' but the batch endpoint is '{endpoint}'.",
                param="endpoint",
            )
        for other in self.metadata.batches_using_file(file.id):
            if other.input_file_id == file.id and other.status.is_active:
                raise InvalidRequest(
                    f"Batch '{other.id}' is already running on file '{file.id}'; "
                    "wait for it to finish before submitting the file again.",
                    param="input_file_id",
                )
        fits_ever = file.line_count <= self.intake.capacity
        if fits_ever and file.line_count > self.intake.free:
            raise IntakeFull(
                f"The server is at capacity: {self.intake.free} of {self.intake.capacity} intake "
                f"slots are free and this batch has {file.line_count} requests. Retry later.",
                retry_after_s=30,
            )
        now = _now()
        batch = Batch(
            id=new_object_id("batch_"),
            endpoint=endpoint,
            input_file_id=file.id,
            completion_window=completion_window,
            status=BatchStatus.VALIDATING,
            created_at=now,
            expires_at=now + window_s,
            model=self.backend.model_name,
            parameters=parameters,
            metadata=metadata,
            request_counts=RequestCounts(total=file.line_count),
        )
        self.metadata.insert_batch(batch)
        if idempotency_key is not None:
            self.metadata.put_idempotency_key(idempotency_key, "batch", fingerprint, batch.id, now)
        running = self._track(batch)
        self.tasks.start_soon(self._start_batch, running, file, None)
        return running.snapshot()

    def _track(self, batch: Batch) -> _RunningBatch:
        running = _RunningBatch(
            batch=batch,
            output=OutputWriter(self.blobs.output_path(batch.id)),
            errors=OutputWriter(self.blobs.error_path(batch.id)),
        )
        self._running[batch.id] = running
        return running

    async def _start_batch(self, running: _RunningBatch, file: FileObject, done: set[str] | None) -> None:
        """Index the input, queue what is still to run, and move the batch to in_progress."""
        try:
            index = await anyio.to_thread.run_sync(index_batch_file, file.path)
            lines: Sequence[int] | None = None
            if done:
                lines = await anyio.to_thread.run_sync(_lines_not_done, file.path, index, done)
        except OSError as exc:
            self._fail(running, "batch_failed", f"Could not read the input file: {exc}")
            return
        if (
            running.batch.status is not BatchStatus.VALIDATING
            and running.batch.status is not BatchStatus.IN_PROGRESS
        ):
            return  # cancelled while indexing
        pending = len(index) if lines is None else len(lines)
        if pending > self.intake.free:
            self._fail(
                running,
                "capacity_exceeded",
                f"The batch has {pending} requests to queue but the intake pool has room for "
                f"{self.intake.free} of {self.intake.capacity}. Retry later or split the file.",
            )
            return
        running.input_fd = os.open(file.path, os.O_RDONLY)
        if running.batch.output_file_id is None:
            output = self._new_output_file(running.batch.id, running.output.path, "output")
            running.batch = attrs.evolve(running.batch, output_file_id=output.id)
        if running.batch.status is BatchStatus.VALIDATING:
            running.batch = attrs.evolve(running.batch, status=BatchStatus.IN_PROGRESS, in_progress_at=_now())
        self._persist(running)
        self.intake.add(running.batch.id, index, lines)
        self.scheduler.notify()
        self._maybe_finish(running)

    def _new_output_file(self, batch_id: str, path: Path, kind: str) -> FileObject:
        now = _now()
        lifetime = self.settings.file_expiry_s
        file = FileObject(
            id=new_object_id("file-"),
            bytes=0,
            created_at=now,
            expires_at=None if lifetime is None else now + lifetime,
            filename=f"{batch_id}_{kind}.jsonl",
            purpose=OUTPUT_PURPOSE,
            path=str(path),
        )
        self.metadata.insert_file(file)
        return file

    async def get_batch(self, batch_id: str) -> Batch:
        running = self._running.get(batch_id)
        if running is not None:
            return running.snapshot()
        batch = self.metadata.get_batch(batch_id)
        if batch is None:
            raise NotFound(f"No batch with id '{batch_id}'.")
        return batch

    async def list_batches(self, *, after: str | None = None, limit: int = 20) -> tuple[list[Batch], bool]:
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be between 1 and 100", param="limit")
        batches, has_more = self.metadata.list_batches(after=after, limit=limit)
        live = [
            self._running[batch.id].snapshot() if batch.id in self._running else batch for batch in batches
        ]
        return live, has_more

    async def cancel_batch(self, batch_id: str) -> Batch:
        """Drop the batch's queued requests at once and abort those in flight."""
        running = self._running.get(batch_id)
        if running is None:
            batch = await self.get_batch(batch_id)
            raise Conflict(f"Batch '{batch_id}' is {batch.status.value} and cannot be cancelled.")
        if running.batch.status is BatchStatus.CANCELLING:
            return running.snapshot()
        if running.batch.status is BatchStatus.FINALIZING:
            raise Conflict(f"Batch '{batch_id}' is finalizing and cannot be cancelled.")
        running.batch = attrs.evolve(running.batch, status=BatchStatus.CANCELLING, cancelling_at=_now())
        self._persist(running)
        self._stop_work(running)
        self._maybe_finish(running)
        return running.snapshot()

    async def wait_for_batch(self, batch_id: str, *, poll_interval: float = 0.05) -> Batch:
        """Wait until the batch reaches a terminal status and return it (for pipelines and tests)."""
        while True:
            batch = await self.get_batch(batch_id)
            if batch.status.is_terminal:
                return batch
            await anyio.sleep(poll_interval)

    # --- monitoring -----------------------------------------------------------------------
    def pool_status(self) -> PoolStatus:
        return PoolStatus(
            intake_pool_size=self.intake.size,
            intake_pool_capacity=self.intake.capacity,
            scheduling_pool_active=self.slots.active,
            scheduling_pool_free=self.slots.free,
            scheduling_pool_capacity=self.slots.capacity,
            active_batches=len(self._running),
        )

    def health(self) -> Health:
        if self._tasks is None:
            return Health(False, "the batch service is not running")
        return self.backend.health()

    def models(self) -> list[dict[str, Any]]:
        return [
            {
                "id": self.backend.model_name,
                "object": "model",
                "created": self._started_at,
                "owned_by": "batchgen",
            }
        ]

    # --- running requests -----------------------------------------------------------------
    async def _run_request(self, entry: IntakeEntry) -> None:
        running = self._running.get(entry.batch_id)
        if running is None or running.batch.status is not BatchStatus.IN_PROGRESS:
            return
        assert running.input_fd is not None
        line = _decode(os.pread(running.input_fd, entry.length, entry.offset))
        custom_id: str = line["custom_id"]
        body: dict[str, Any] = line["body"]
        try:
            sampling = resolve_sampling(body, running.batch.parameters, self._defaults)
        except InvalidRequest as exc:
            self._record_error(running, custom_id, "invalid_request", exc.message)
            return
        request = GenerationRequest(
            request_id=new_request_id("req_"),
            endpoint=running.batch.endpoint,
            sampling=sampling,
            messages=tuple(body["messages"]) if "messages" in body else None,
            prompt=body.get("prompt"),
        )
        running.in_flight.add(request.request_id)
        try:
            result = await self._generate(request)
        except RequestRejected as exc:
            self._record_error(running, custom_id, exc.code, exc.message)
        except RequestAborted:
            pass  # cancelled or expired: the request ends with no line
        except BackendUnavailable as exc:
            self._fail(running, "batch_failed", f"The inference backend became unavailable: {exc}")
        else:
            if running.batch.status.is_terminal:
                return  # the batch ended (expired, failed) while this request ran
            line = output_line(
                custom_id, request.request_id, request.endpoint, self.backend.model_name, result, _now()
            )
            if self._write(running, running.output, line):
                running.completed += 1
                running.prompt_tokens += result.prompt_tokens
                running.completion_tokens += result.completion_tokens
                running.dirty = True
        finally:
            running.in_flight.discard(request.request_id)
            self._maybe_finish(running)

    def _write(self, running: _RunningBatch, writer: OutputWriter, line: bytes) -> bool:
        """Append a result line; on a storage fault fail the batch (earlier lines stay intact)."""
        try:
            writer.append(line)
        except OSError as exc:
            self._fail(
                running,
                "batch_failed",
                f"Could not write results to {writer.path}: {exc.strerror or exc}. "
                "Lines written before this are kept.",
            )
            return False
        return True

    async def _generate(self, request: GenerationRequest) -> Any:
        attempts = self.settings.max_request_attempts
        for attempt in range(1, attempts + 1):
            try:
                return await self.backend.generate(request)
            except TransientBackendError as exc:
                if attempt == attempts:
                    raise RequestRejected(
                        "backend_error", f"The backend failed this request {attempts} times: {exc}"
                    ) from exc
                logger.info("retrying %s after: %s", request.request_id, exc)
                await anyio.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    def _record_error(self, running: _RunningBatch, custom_id: str, code: str, message: str) -> None:
        if running.batch.status.is_terminal:
            return
        if running.batch.error_file_id is None:
            errors = self._new_output_file(running.batch.id, running.errors.path, "error")
            running.batch = attrs.evolve(running.batch, error_file_id=errors.id)
            self._persist(running)
        if self._write(running, running.errors, error_line(custom_id, code, message)):
            running.failed += 1
            running.dirty = True

    def _maybe_finish(self, running: _RunningBatch) -> None:
        status = running.batch.status
        if status is BatchStatus.IN_PROGRESS and running.finished >= running.batch.request_counts.total:
            self._complete(running)
        elif status is BatchStatus.CANCELLING and not running.in_flight:
            self._end(running, status=BatchStatus.CANCELLED, cancelled_at=_now())

    def _complete(self, running: _RunningBatch) -> None:
        running.batch = attrs.evolve(running.batch, status=BatchStatus.FINALIZING, finalizing_at=_now())
        self._persist(running)
        self._end(running, status=BatchStatus.COMPLETED, completed_at=_now())

    def _fail(self, running: _RunningBatch, code: str, message: str) -> None:
        if running.batch.status.is_terminal:
            return
        logger.warning("batch %s failed: %s", running.batch.id, message)
        self._stop_work(running)
        self._end(running, status=BatchStatus.FAILED, failed_at=_now(), error=BatchErrorInfo(code, message))

    def _stop_work(self, running: _RunningBatch) -> None:
        """Drop the batch's queued requests and abort those in flight (they end with no line)."""
        self.intake.drop(running.batch.id)
        for request_id in list(running.in_flight):
            self.tasks.start_soon(self.backend.abort, request_id)

    def _end(self, running: _RunningBatch, **changes: Any) -> None:
        """Move a batch to a terminal status: sync its files, persist, stop tracking it."""
        self._close(running)
        running.batch = attrs.evolve(running.batch, **changes)
        self._persist(running)
        self._running.pop(running.batch.id, None)

    def _close(self, running: _RunningBatch) -> None:
        for writer in (running.output, running.errors):
            try:
                writer.close()
            except OSError:
                logger.exception("closing %s failed", writer.path)
        if running.input_fd is not None:
            os.close(running.input_fd)
            running.input_fd = None

    def _persist(self, running: _RunningBatch) -> None:
        self.metadata.save_batch(running.snapshot())
        running.dirty = False

    async def _flush_counters_periodically(self) -> None:
        while True:
            await anyio.sleep(self.settings.counters_flush_interval_s)
            for running in list(self._running.values()):
                if running.dirty:
                    self._persist(running)

    async def _sync_outputs_periodically(self) -> None:
        """Group commit: one fsync per open result file per interval, never one per request."""
        while True:
            await anyio.sleep(self.settings.fsync_interval_ms / 1000)
            writers = [w for r in self._running.values() for w in (r.output, r.errors) if w.opened]
            if writers:
                await anyio.to_thread.run_sync(_sync_all, writers)

    async def _expire_periodically(self) -> None:
        while True:
            await anyio.sleep(self.settings.maintenance_interval_s)
            self.expire_due()

    def expire_due(self) -> None:
        """End batches past their completion window as ``expired``, and delete expired files."""
        now = _now()
        for running in list(self._running.values()):
            if running.batch.expires_at <= now and not running.batch.status.is_terminal:
                logger.info(
                    "batch %s expired with %d of %d done",
                    running.batch.id,
                    running.finished,
                    running.batch.request_counts.total,
                )
                self._stop_work(running)
                self._end(running, status=BatchStatus.EXPIRED, expired_at=now)
        for file in self.metadata.expired_files(now):
            if not any(b.status.is_active for b in self.metadata.batches_using_file(file.id)):
                self.metadata.delete_file(file.id)
                self.blobs.remove(file.path)

    # --- recovery -------------------------------------------------------------------------
    async def _recover(self) -> None:
        """Resume every batch a previous run left unfinished, skipping lines already written."""
        for batch in self.metadata.active_batches():
            if batch.status is BatchStatus.CANCELLING:
                self.metadata.save_batch(
                    attrs.evolve(batch, status=BatchStatus.CANCELLED, cancelled_at=_now())
                )
                continue
            file = self.metadata.get_file(batch.input_file_id)
            running = self._track(batch)
            if file is None:
                self._fail(running, "batch_failed", "The batch's input file is gone.")
                continue
            # Counters are rebuilt from the files, the record of what really finished.
            written = read_finished_lines(running.output.path)
            failed = read_finished_lines(running.errors.path)
            running.completed, running.failed = len(written.custom_ids), len(failed.custom_ids)
            running.prompt_tokens = written.prompt_tokens
            running.completion_tokens = written.completion_tokens
            if batch.status is BatchStatus.FINALIZING:
                running.batch = attrs.evolve(batch, status=BatchStatus.IN_PROGRESS)
            logger.info("resuming batch %s: %d lines already written", batch.id, running.finished)
            done = set(written.custom_ids) | set(failed.custom_ids)
            self.tasks.start_soon(self._start_batch, running, file, done)


def _sync_all(writers: list[OutputWriter]) -> None:
    for writer in writers:
        try:
            writer.sync()
        except (OSError, ValueError):
            logger.exception("fsync of %s failed", writer.path)


def _lines_not_done(path: str, index: Any, done: set[str]) -> list[int]:
    """Positions of the request lines whose custom_id has no output or error line yet."""
    pending: list[int] = []
    with open(path, "rb") as stream:
        for position, (offset, length) in enumerate(zip(index.offsets, index.lengths, strict=True)):
            stream.seek(offset)
            if _decode(stream.read(length))["custom_id"] not in done:
                pending.append(position)
    return pending
