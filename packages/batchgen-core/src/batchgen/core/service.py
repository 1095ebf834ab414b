"""BatchService: the one facade over files, batches, pools, scheduler, storage and backend.

The REST server calls it, and a custom pipeline can embed it with no HTTP at all::

    async with BatchService(ServiceSettings(storage_path=path), backend) as service:
        file = await service.create_file(b'{"custom_id": ...}\\n', filename="in.jsonl")
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        batch = await service.wait_for_batch(batch.id)

The facade checks calls and delegates; the work is done by parts with one job each:

- ``FileCatalogue`` (files and their contents) and ``IdempotencyLedger`` (repeated calls);
- ``BatchTracker`` (unfinished batches; every status change goes through ``batches.lifecycle``);
- ``BatchStarter`` (index a batch's input and queue it) and ``recovery`` (resume after a restart);
- the intake pool, the scheduling pool and the ``Scheduler`` (``scheduling``);
- ``RequestExecutor`` (run requests, in groups, on the model each line names, and write exactly
  one line for each);
- the served models (``served_models``): one backend, or several models each with its own
  backend, whose slots ``ModelShares`` shares fairly;
- ``Maintenance`` (supervised periodic jobs: counter flushes, fsyncs, expiry), and the
  ``Supervisor`` (the scheduler loop and one-shot tasks: a crash stops the core, visibly).

Tenants: every call takes an optional ``caller`` (``tenancy.Caller``). Objects belong to the
caller's tenant; a caller that is not an admin sees only its tenant's objects (another tenant's id
is NotFound) and is held to its tenant's limits. Without a caller, a call is made as ``EMBEDDED``
(an admin of the ``default`` tenant), which is how the service behaved before tenants.

Starting goes through one ``AsyncExitStack``: a failure at any step undoes the steps before it.
A storage fault (a full disk, an I/O error, a read-only folder) in a call raises
``StorageUnavailable`` and leaves nothing half made; in a batch it fails nothing: result lines the
storage refuses are held in memory and work pauses (health 503 naming the fault) until they are
written (``execution.held_results``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import anyio
import anyio.abc
import attrs

from batchgen.core.backends.base import Backend
from batchgen.core.backends.engine_activity import activity_of, combined_activity
from batchgen.core.backends.served_models import DEFAULT_MODEL_ALIAS, ModelSet, ServedModel
from batchgen.core.batches.deadline_watch import DeadlineWatch
from batchgen.core.batches.log import log_created
from batchgen.core.batches.options import (
    check_metadata,
    check_output_expiry,
    check_parameters,
    parse_completion_window,
)
from batchgen.core.batches.ordering_step import OrderingStep
from batchgen.core.batches.output_order import COMPLETION, OUTPUT_ORDERS, check_output_order
from batchgen.core.batches.recovery import recover
from batchgen.core.batches.result_merge import FamilyIndex
from batchgen.core.batches.retry import BatchRetries, RetryRequest, with_retries
from batchgen.core.batches.starter import BatchStarter
from batchgen.core.batches.tracker import BatchTracker
from batchgen.core.clock import deadline, exact_now, now, reached
from batchgen.core.errors import (
    Conflict,
    IntakeFull,
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
    StorageUnavailable,
)
from batchgen.core.execution.executor import RequestExecutor
from batchgen.core.execution.held_results import RETRY_INTERVAL_S as HELD_RESULTS_RETRY_S
from batchgen.core.execution.result_cache import FILE_NAME as RESULT_CACHE_FILE
from batchgen.core.execution.result_cache import FLUSH_INTERVAL_S, ResultCache, ResultCacheSettings
from batchgen.core.execution.shared_storage import SharedStorage
from batchgen.core.files.batch_file import first_line_model
from batchgen.core.files.catalogue import MAX_FILE_EXPIRY_S, FileCatalogue
from batchgen.core.files.chunked_uploads import (
    DEFAULT_MAX_OPEN_UPLOADS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_UPLOAD_EXPIRY_S,
    MAX_PARTS,
    ChunkedUploads,
    Upload,
    UploadPart,
)
from batchgen.core.files.content import DiskContent, FileContent
from batchgen.core.files.upload_parts import PartDestination
from batchgen.core.idempotency import IdempotencyLedger, fingerprint
from batchgen.core.ids import new_object_id
from batchgen.core.maintenance import Maintenance
from batchgen.core.models import (
    SUPPORTED_ENDPOINTS,
    Batch,
    BatchParameters,
    BatchStatus,
    FileObject,
    Health,
    PoolStatus,
    RequestCounts,
)
from batchgen.core.requests.parameters import ServerDefaults
from batchgen.core.scheduling import Finished, IntakeEntry, IntakePool, Scheduler, SchedulingPool
from batchgen.core.scheduling.model_shares import ModelShares
from batchgen.core.storage import BlobStore, LocalBlobStore, MetadataStore, ResultWriter, SQLiteMetadataStore
from batchgen.core.storage.faults import storage_faults_as_errors
from batchgen.core.storage.folder_lock import FolderLock
from batchgen.core.storage.interfaces import IdempotencyRecord
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.supervision import Supervisor
from batchgen.core.telemetry import RequestTelemetry
from batchgen.core.tenancy import EMBEDDED, Caller, TenantLimits, TenantUsage
from batchgen.core.url_redaction import redacted_repr
from batchgen.core.webhook_outbox import WebhookTargets

if TYPE_CHECKING:
    from batchgen.core.execution.replica_work import ReplicaWork

__all__ = ["MAX_FILE_EXPIRY_S", "BatchService", "ServiceSettings", "parse_completion_window"]

logger = logging.getLogger("batchgen.service")

ERROR_FILE_MODES = ("output", "openai")
#: ``Retry-After`` seconds for a batch the replicas' shared intake has no room for now.
SHARED_INTAKE_RETRY_AFTER_S = 5
__all__ += ["DEFAULT_MODEL_ALIAS", "ModelSet", "ServedModel"]


def _names(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _open_shared_metadata(shared: SharedStorage, _path: Path) -> MetadataStore:
    from batchgen.core.storage.postgres_metadata import PostgresMetadataStore  # psycopg: only here

    return PostgresMetadataStore(shared.metadata_url)


def _open_shared_blobs(shared: SharedStorage, storage_path: Path) -> BlobStore:
    """The shared folder's files, or the object store's with this replica's copies and staging
    under its own ``storage_path``."""
    folder = shared.folder
    if folder is not None:
        return LocalBlobStore(folder, staging_dir=shared.staging_dir)
    from batchgen.core.storage.object_blobs import ObjectBlobStore  # obstore: only here

    return ObjectBlobStore.from_url(shared.blob_url, storage_path)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _storage_call(action: str) -> Callable[[Callable[_P, Awaitable[_R]]], Callable[_P, Awaitable[_R]]]:
    """A service call whose storage faults are raised as ``StorageUnavailable`` naming ``action``."""

    def decorate(call: Callable[_P, Awaitable[_R]]) -> Callable[_P, Awaitable[_R]]:
        @functools.wraps(call)
        async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with storage_faults_as_errors(action):
                return await call(*args, **kwargs)

        return wrapper

    return decorate


#: The statuses a cancel has already reached: cancelling again returns the batch as it is.
_CANCELLED_OR_CANCELLING = frozenset({BatchStatus.CANCELLING, BatchStatus.CANCELLED})


@attrs.frozen
class ServiceSettings:
    """Everything the service needs besides its backend."""

    storage_path: Path = attrs.field(converter=Path)
    max_intake_capacity: int = 1_000_000
    max_pool_size: int = 10_240
    max_upload_bytes: int = 512 * 1024 * 1024
    #: The Uploads API (``chunked_uploads``): the most bytes one upload may declare, and how long
    #: an upload may take before it expires.
    max_chunked_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    upload_expiry_s: int = DEFAULT_UPLOAD_EXPIRY_S
    #: The most parts one upload may have, and the most uploads one tenant may have open (None:
    #: no limit).
    max_upload_parts: int = MAX_PARTS
    max_open_uploads: int | None = DEFAULT_MAX_OPEN_UPLOADS
    default_max_tokens: int = 256
    max_request_attempts: int = 3
    counters_flush_interval_s: float = 0.5
    fsync_interval_ms: int = 1000
    shutdown_grace_s: float = 10.0
    file_expiry_s: int | None = None
    maintenance_interval_s: float = 0.5
    #: "output": failed requests' lines go to the output file and a batch that runs out of its
    #: completion window ends ``failed`` (the user guide); "openai": failed lines go to a separate
    #: error file and such a batch ends ``expired`` (OpenAI's Batch API).
    error_file: str = attrs.field(default="output", validator=attrs.validators.in_(ERROR_FILE_MODES))
    #: More names the model answers to in a request's ``model`` field, besides its own name.
    served_model_names: tuple[str, ...] = attrs.field(default=(), converter=_names)
    #: ``Retry-After`` seconds sent with a 503 while the service is unhealthy.
    unhealthy_retry_after_s: int = 5
    #: Where each batch's terminal webhook event goes (saved in the outbox with the status), and
    #: whether a batch may name its own URL in its metadata (``webhook_outbox``).
    webhook_urls: tuple[str, ...] = attrs.field(default=(), converter=_names, repr=redacted_repr)
    webhook_batch_urls: bool = False
    #: The tenants whose deterministic requests the result cache answers, and its bounds
    #: (``result_cache``); no tenant: no cache, and no cache file.
    result_cache: ResultCacheSettings = attrs.field(factory=ResultCacheSettings)
    #: The order of a batch's result files when its create call does not say (``output_order``):
    #: "completion" (as requests finish) or "input" (rewritten in input order when it ends).
    output_order: str = attrs.field(default=COMPLETION, validator=attrs.validators.in_(OUTPUT_ORDERS))
    #: Whether a batch's lines that share a prompt prefix are admitted together (``prefix_groups``),
    #: so that an engine's prefix cache computes the prefix once; False: in file order.
    prefix_grouping: bool = True
    #: Where this service shares its state with other replicas (``execution.shared_storage``):
    #: its metadata in PostgreSQL, file contents and output in a folder they all mount, and its
    #: batches run by whichever replica claims their shards. None: one process on its own folder.
    shared: SharedStorage | None = None


class _Parts:
    """The parts a started service delegates to (they need the open metadata store)."""

    def __init__(self, service: BatchService, metadata: MetadataStore, tasks: anyio.abc.TaskGroup) -> None:
        settings = service.settings
        self.metadata = metadata
        self.tasks = tasks
        #: How the API's calls reach the metadata store: in place, or in worker threads.
        self.calls = MetadataCalls(metadata)
        self.ledger = IdempotencyLedger(metadata, self.calls)
        self.tracker = BatchTracker(
            metadata,
            service.blobs,
            service.intake_pool,
            abort_request=lambda request_id: tasks.start_soon(
                functools.partial(
                    service.supervisor.run,
                    f"abort {request_id}",
                    service.model_set.abort,
                    request_id,
                    critical=False,
                )
            ),
            outbox=lambda batch: service.webhooks.messages(batch, now()),
            on_end=service.telemetry.batch_ended,
            calls=self.calls,
        )
        self.deadlines = DeadlineWatch(self.tracker, service.webhooks)
        self.files = FileCatalogue(
            metadata,
            service.blobs,
            self.ledger,
            calls=self.calls,
            max_upload_bytes=settings.max_upload_bytes,
            file_expiry_s=settings.file_expiry_s,
            in_use=service._live_user_of_file,
            served_models=service.model_set,
            tenant_limits=service.tenant_limits,
        )
        files = self.files
        self.uploads: ChunkedUploads | SharedUploads
        if settings.shared is not None:  # any replica serves any call of an upload
            from batchgen.core.files.shared_uploads import SharedUploads
            from batchgen.core.storage.postgres_metadata import PostgresMetadataStore
            from batchgen.core.storage.upload_part_blobs import open_part_blobs

            assert isinstance(metadata, PostgresMetadataStore)
            self.uploads = SharedUploads(
                metadata.upload_records(),
                open_part_blobs(settings.shared.blob_url),
                service.blobs,
                self.calls,
                max_upload_bytes=settings.max_chunked_upload_bytes,
                expiry_s=settings.upload_expiry_s,
                served_models=service.model_set,
                file_record=files.file_of,
                new_file=files.file_record,
                max_parts=settings.max_upload_parts,
                max_open_uploads=settings.max_open_uploads,
            )
            service.maintenance.add(
                "expire uploads", settings.maintenance_interval_s, self.uploads.expire_pending
            )
        else:
            self.uploads = ChunkedUploads(
                service.settings.storage_path / "uploads",
                max_upload_bytes=settings.max_chunked_upload_bytes,
                expiry_s=settings.upload_expiry_s,
                served_models=service.model_set,
                register_file=files.register,
                file_record=files.file_of,
                new_file=files.file_record,
                final_path=service.blobs.upload_path,
                quota=files.quota,
                max_parts=settings.max_upload_parts,
                max_open_uploads=settings.max_open_uploads,
            )
        self.starter = BatchStarter(
            self.tracker,
            self.files,
            service.intake_pool,
            service.scheduler.notify,
            on_queued=service.telemetry.batch_queued,
            group_prefixes=settings.prefix_grouping,
        )
        self.executor = RequestExecutor(
            self.tracker,
            self.files,
            service.model_set,
            defaults=ServerDefaults(max_tokens=settings.default_max_tokens),
            max_attempts=settings.max_request_attempts,
            separate_error_file=settings.error_file == "openai",
            telemetry=service.telemetry,
            result_cache=service.result_cache,
            on_pause=service._pause_for_storage,
        )
        self.ordering = OrderingStep(self.tracker, metadata, self.calls, service._spawn)
        self.tracker.end_in_order = self.ordering.begin


class BatchService:
    """Files, batches and the machinery that runs them; use as an async context manager."""

    def __init__(
        self,
        settings: ServiceSettings,
        backend: Backend | ModelSet | list[ServedModel],
        *,
        open_metadata: Callable[[Path], MetadataStore] | None = None,
        blobs: BlobStore | None = None,
    ) -> None:
        """``backend`` is the one backend to serve (its model answering also to
        ``settings.served_model_names``), or the models to serve, the first being the default.
        ``open_metadata(path)`` and ``blobs`` replace the SQLite store (opened at start) and the
        local blob store under ``settings.storage_path``."""
        self.settings = settings
        self.model_set = ModelSet.of(backend, settings.served_model_names)
        #: The default model's backend.
        self.backend = self.model_set.default.backend
        shared = settings.shared
        if shared is not None:  # the database and the folder every replica shares
            open_metadata = open_metadata or functools.partial(_open_shared_metadata, shared)
            if blobs is None:
                blobs = _open_shared_blobs(shared, settings.storage_path)
        self._open_metadata = open_metadata or SQLiteMetadataStore
        self.blobs: BlobStore = blobs if blobs is not None else LocalBlobStore(settings.storage_path)
        #: This replica's share of the work, while it runs with ``settings.shared``.
        self.replica: ReplicaWork | None = None
        self._replica_done = anyio.Event()
        self.supervisor = Supervisor()
        self.intake_pool = IntakePool(settings.max_intake_capacity)
        self._tenant_limits: dict[str, TenantLimits] = {}
        self.scheduling_pool = SchedulingPool(settings.max_pool_size)
        shares = (
            ModelShares(settings.max_pool_size, self._model_of_batch) if len(self.model_set) > 1 else None
        )
        self.scheduler = Scheduler(
            self.intake_pool, self.scheduling_pool, shares=shares, run_group=self._run_group
        )
        self.maintenance = Maintenance()
        #: Counters and latency histograms of the requests run (read by the server's /metrics).
        self.telemetry = RequestTelemetry()
        self.webhooks = WebhookTargets(settings.webhook_urls, settings.webhook_batch_urls)
        self._parts: _Parts | None = None
        self._exit_stack: AsyncExitStack | None = None
        self._started_at = now()
        #: One owner per storage folder (``folder_lock``): held from the start to the stop.
        self._folder_lock = FolderLock(settings.storage_path)
        self._shutdown_deadline: float | None = None
        #: The result cache, open while the service runs, when some tenant uses it.
        self.result_cache: ResultCache | None = None
        #: Retries of ended batches, and the merged view of a batch and its retries.
        self.retries = BatchRetries(self)

    # --- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> BatchService:
        try:
            await self._start()
        except BaseExceptionGroup as group:  # the task group wraps a failure of a start step
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        return self

    async def _start(self) -> None:
        async with AsyncExitStack() as stack:
            self._folder_lock.acquire()  # StorageFolderInUse before anything in the folder is touched
            stack.callback(self._folder_lock.release)
            self._shutdown_deadline = None
            metadata = self._open_metadata(self.settings.storage_path / "metadata.sqlite3")
            stack.callback(metadata.close)
            if self.settings.result_cache.enabled:
                self.result_cache = ResultCache(
                    self.settings.storage_path / RESULT_CACHE_FILE, self.settings.result_cache
                )
                stack.callback(self._close_result_cache)
            self.blobs.clear_staging()
            await self.model_set.start()
            stack.push_async_callback(self.model_set.stop)
            stack.callback(self._close_parts)  # runs once every task below has ended
            tasks = await stack.enter_async_context(anyio.create_task_group())
            self._parts = parts = _Parts(self, metadata, tasks)
            stack.push_async_callback(self._drain, tasks)
            await tasks.start(self._run_scheduler)
            if parts.calls.in_threads:  # saves of a store across a network: off the event loop
                self._spawn(parts.tracker.run_saver)  # supervised: a crash stops the core visibly
            self.maintenance.add(
                "flush counters", self.settings.counters_flush_interval_s, parts.tracker.flush
            )
            self.maintenance.add("fsync results", self.settings.fsync_interval_ms / 1000, self._sync_results)
            self.maintenance.add("expiry", self.settings.maintenance_interval_s, self.expire_due)
            self.maintenance.add("write held results", HELD_RESULTS_RETRY_S, parts.executor.write_held)
            if self.result_cache is not None:
                self.maintenance.add("write result cache", FLUSH_INTERVAL_S, self.result_cache.flush)
            self.maintenance.add(
                "deadline watch", self.settings.maintenance_interval_s, parts.deadlines.check
            )
            if self.settings.shared is not None:  # every replica's batches: it takes shards of them
                await self._start_replica(self.settings.shared, parts)
            self.maintenance.start(tasks)
            if self.settings.shared is None:  # resuming this process's own unfinished batches
                recover(metadata, self.blobs, parts.tracker, parts.starter, self._spawn, parts.ordering.begin)
            await parts.uploads.recover()
            self._exit_stack = stack.pop_all()

    async def _start_replica(self, shared: SharedStorage, parts: _Parts) -> None:
        from batchgen.core.execution.replica_work import ReplicaWork  # psycopg: only in this mode

        replica = ReplicaWork(
            shared,
            parts.metadata,
            parts.calls,
            self.model_set,
            self.blobs,
            defaults=ServerDefaults(max_tokens=self.settings.default_max_tokens),
            max_attempts=self.settings.max_request_attempts,
            separate_error_file=self.settings.error_file == "openai",
            intake_capacity=self.settings.max_intake_capacity,
            slots=self.settings.max_pool_size,
            webhooks=self.webhooks,
        )
        await replica.open()
        self.replica, self._replica_done = replica, anyio.Event()
        self._spawn(self._run_replica, replica)
        self.maintenance.add(
            "end shared batches", self.settings.maintenance_interval_s, replica.batches.end_due
        )

    async def _run_replica(self, replica: ReplicaWork) -> None:
        """Take shards until the service stops (supervised: a crash stops the core visibly)."""
        try:
            await replica.run()
        finally:
            with anyio.CancelScope(shield=True):
                await replica.close()
            self._replica_done.set()

    def _close_result_cache(self) -> None:
        cache, self.result_cache = self.result_cache, None
        if cache is not None:
            cache.close()

    async def __aexit__(self, *exc_info: Any) -> None:
        """Stop admitting, give running requests ``shutdown_grace_s`` to finish, persist, stop.

        Requests still running after the grace period are abandoned without a line; the next
        start queues them again. A background task that crashed is raised here, not hidden.
        """
        stack, self._exit_stack = self._exit_stack, None
        if stack is not None:
            await stack.__aexit__(*exc_info)

    async def _run_scheduler(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The scheduler loop, supervised: a crash stops the core visibly instead of silently."""
        try:
            await self.scheduler.run(task_status=task_status)
        except Exception as exc:
            self.supervisor.record_crash("scheduler", exc)

    def _spawn(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a supervised one-shot task (a batch start) in the service's task group."""
        name = getattr(function, "__qualname__", "task")
        self.parts.tasks.start_soon(functools.partial(self.supervisor.run, name, function, *args))

    def on_stop(self, listener: Callable[[str], object]) -> None:
        """Call ``listener(reason)`` if the core stops while running (a supervised task crashed)."""
        self.supervisor.on_stop(listener)

    def begin_shutdown(self) -> None:
        """Stop admitting requests now and start the ``shutdown_grace_s`` of running ones now.

        A server calls this when it is told to stop, before it drains its connections, so that
        the grace period bounds the whole shutdown; leaving the ``async with`` then waits only for
        what is left of it. Calling it again changes nothing.
        """
        self.scheduler.paused = True
        if self._shutdown_deadline is None:
            self._shutdown_deadline = time.monotonic() + self.settings.shutdown_grace_s

    async def _drain(self, tasks: anyio.abc.TaskGroup) -> None:
        self.begin_shutdown()
        left_s = (self._shutdown_deadline or 0.0) - time.monotonic()
        with anyio.move_on_after(max(0.0, left_s)):
            if self.replica is not None:  # its leases let go now, not when they run out
                self.replica.stop()
                await self._replica_done.wait()
            while self.scheduling_pool.active:
                await anyio.sleep(0.02)
        if self.scheduling_pool.active:
            logger.warning(
                "shutting down with %d requests still running; they will rerun", self.scheduling_pool.active
            )
        tasks.cancel_scope.cancel()

    def _close_parts(self) -> None:
        """Persist and close every unfinished batch (the next start resumes them); result lines
        still held (a full disk) get one last try, else their requests run again at the next start."""
        if self._parts is not None:
            if self._parts.executor.held.paused:
                try:
                    self._parts.executor.write_held()
                except StorageUnavailable as exc:
                    logger.warning(
                        "%d held result lines are not written at shutdown; the next start runs "
                        "their requests again: %s",
                        self._parts.executor.held.lines,
                        exc.message,
                    )
            self._parts.tracker.close_all()
            self._parts = None

    @property
    def parts(self) -> _Parts:
        if self._parts is None:
            raise RuntimeError("BatchService is not started; use 'async with service:'")
        return self._parts

    @property
    def metadata(self) -> MetadataStore:
        return self.parts.metadata

    @property
    def max_upload_bytes(self) -> int:
        return self.settings.max_upload_bytes

    def _model_of_batch(self, batch_id: str) -> str:
        active = self._parts.tracker.get(batch_id) if self._parts is not None else None
        return active.batch.model if active is not None else ""

    def _pause_for_storage(self, paused: bool) -> None:
        """Hold (or release) the admission of new requests while result lines wait for the storage."""
        if paused:
            self.scheduler.hold("result lines held for the storage")
        else:
            self.scheduler.release("result lines held for the storage")

    async def _run_group(self, entries: Sequence[IntakeEntry], finished: Finished) -> None:
        await self.parts.executor.run_group(entries, finished)

    async def _sync_results(self) -> None:
        """Group commit: one fsync per open result file per interval, never one per request."""
        writers = self.parts.tracker.open_writers()
        if writers:
            await anyio.to_thread.run_sync(_sync_all, writers)

    # --- files ----------------------------------------------------------------------------
    def new_upload_path(self) -> Path:
        """A staging path the caller may stream an upload into, then pass to ``add_file``."""
        return self.blobs.new_staging_path()

    def discard_upload(self, staging_path: Path) -> None:
        """Remove a staging file (harmless when ``add_file`` already consumed it)."""
        self.blobs.remove(staging_path)

    @_storage_call("store the file")
    async def create_file(
        self,
        content: bytes | str | os.PathLike[str],
        *,
        filename: str | None = None,
        purpose: str = "batch",
        caller: Caller = EMBEDDED,
    ) -> FileObject:
        """Store a file given as bytes or as a path on disk (copied, not moved)."""
        return await self.parts.files.create_file(content, filename=filename, purpose=purpose, caller=caller)

    @_storage_call("store the file")
    async def add_file(
        self,
        staging_path: Path,
        *,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
        idempotency_key: str | None = None,
        caller: Caller = EMBEDDED,
    ) -> FileObject:
        """Validate a file received into ``staging_path`` and store it; the staging file is consumed.

        ``expires_after_s`` (else the server's ``file_expiry_s``) deletes the file that long after
        its creation. With ``idempotency_key``, the same upload again returns the first file.
        """
        if self.replica is not None and caller.limits.max_stored_bytes is not None:  # before the work
            await self.parts.uploads.check_quota(caller, staging_path.stat().st_size)
        return await self.parts.files.add_file(
            staging_path,
            filename=filename,
            purpose=purpose,
            expires_after_s=expires_after_s,
            idempotency_key=idempotency_key,
            caller=caller,
            max_stored_bytes=caller.limits.max_stored_bytes,  # admitted with the insert
        )

    # --- the Uploads API (chunked_uploads, or shared_uploads for replicas) ----------------
    @_storage_call("create the upload")
    async def create_upload(
        self,
        *,
        filename: str,
        purpose: str,
        size: int,
        mime_type: str,
        expires_after_s: int | None = None,
        caller: Caller = EMBEDDED,
    ) -> Upload:
        """A pending upload of ``size`` bytes, to which parts are then added; the file it makes
        expires ``expires_after_s`` after it is made (else as ``add_file``'s do)."""
        return await self.parts.uploads.create(
            filename=filename,
            purpose=purpose,
            size=size,
            mime_type=mime_type,
            expires_after_s=expires_after_s,
            caller=caller,
        )

    @_storage_call("receive the part")
    async def new_upload_part(self, upload_id: str, *, caller: Caller = EMBEDDED) -> PartDestination:
        """Where to receive a part of the upload (``open()`` it, write the part's bytes, close it),
        and the part's id; pass it to ``add_upload_part``, or to ``drop_upload_part`` when receiving
        failed."""
        return await self.parts.uploads.new_part(upload_id, caller)

    def drop_upload_part(self, upload_id: str, destination: PartDestination) -> None:
        """Forget a part whose receiving failed (its bytes are deleted)."""
        self.parts.uploads.drop_part(upload_id, destination)

    @_storage_call("store the part")
    async def add_upload_part(
        self, upload_id: str, destination: PartDestination, *, caller: Caller = EMBEDDED
    ) -> UploadPart:
        return await self.parts.uploads.add_part(upload_id, destination, caller)

    @_storage_call("complete the upload")
    async def complete_upload(
        self, upload_id: str, part_ids: Sequence[str], *, md5: str | None = None, caller: Caller = EMBEDDED
    ) -> tuple[Upload, FileObject]:
        """Validate the parts in the order ``part_ids`` names and make them one file."""
        return await self.parts.uploads.complete(upload_id, part_ids, md5, caller)

    @_storage_call("cancel the upload")
    async def cancel_upload(self, upload_id: str, *, caller: Caller = EMBEDDED) -> Upload:
        return await self.parts.uploads.cancel(upload_id, caller)

    @_storage_call("read the upload")
    async def get_upload(self, upload_id: str, *, caller: Caller = EMBEDDED) -> Upload:
        return await self.parts.uploads.get(upload_id, caller)

    @_storage_call("read the file's record")
    async def get_file(self, file_id: str, *, caller: Caller = EMBEDDED) -> FileObject:
        file = await self.parts.files.get(file_id, caller)
        return file if self.replica is None else await self.replica.batches.sized(file)

    @_storage_call("list the files")
    async def list_files(
        self,
        *,
        after: str | None = None,
        limit: int = 10000,
        order: str = "desc",
        purpose: str | None = None,
        caller: Caller = EMBEDDED,
    ) -> tuple[list[FileObject], bool]:
        files, has_more = await self.parts.files.list(
            after=after, limit=limit, order=order, purpose=purpose, caller=caller
        )
        if self.replica is not None:
            files = [await self.replica.batches.sized(file) for file in files]
        return files, has_more

    @_storage_call("delete the file")
    async def delete_file(self, file_id: str, *, caller: Caller = EMBEDDED) -> None:
        file = await self.parts.files.delete(file_id, caller)
        if self.replica is None:
            return
        try:  # a shared batch's result file: its segments go too
            await self.replica.batches.forget(file)
        except Exception:  # the record is gone: the orphan sweep deletes the segments later
            logger.warning("the segments of file %s were not deleted now", file_id, exc_info=True)

    @_storage_call("read the file")
    async def file_content(self, file_id: str, *, caller: Caller = EMBEDDED) -> tuple[Path, int]:
        """The file's path and how many bytes of it to read now (an output file keeps growing).
        A shared batch's result file has no path of its own: read it with ``file_bytes``."""
        content = await self.file_bytes(file_id, caller=caller)
        if not isinstance(content, DiskContent):
            raise InvalidRequest(
                f"File '{file_id}' is a shared batch's result, held in segments; read it with file_bytes()."
            )
        return content.path, content.size

    async def file_bytes(self, file_id: str, *, caller: Caller = EMBEDDED) -> FileContent:
        """The file's bytes, as many as there are now (an output file keeps growing), wherever
        they are held: a file on disk, or a shared batch's committed segments."""
        if self.replica is not None:
            shared = await self.replica.batches.content(await self.parts.files.record(file_id, caller))
            if shared is not None:
                return shared
        return await self.parts.files.content(file_id, caller)

    def _live_user_of_file(self, batches: Sequence[Batch]) -> Batch | None:
        """Of ``batches`` (those naming a file), one that still needs the file (it is running or
        not yet ended), or None."""
        for batch in batches:
            if batch.id in self.parts.tracker or batch.status.is_active:
                return batch
        return None

    # --- batches --------------------------------------------------------------------------
    @_storage_call("record the batch")
    async def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        *,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        parameters: BatchParameters | None = None,
        output_expires_after_s: int | None = None,
        output_order: str | None = None,
        idempotency_key: str | None = None,
        caller: Caller = EMBEDDED,
        retry_of: str | None = None,
        idempotency_call: str | None = None,
        new_input: FileObject | None = None,
    ) -> Batch:
        """Accept a batch over an uploaded ``batch`` file; it starts in the background.

        The batch's requests are reserved in the intake pool before it is accepted, so an accepted
        batch is queued in full; when they do not fit now, IntakeFull (429) says when to retry,
        estimated from the rate at which requests are finishing.

        ``output_expires_after_s`` deletes the batch's output and error files that long after
        each is created. ``output_order`` ("completion" or "input"; None: the server's
        ``output_order``) says whether the result files are rewritten in input order when the batch
        completes or is cancelled. With ``idempotency_key``, a repeat of the same call returns the batch the
        first call created, and the same key with different arguments raises Conflict. While the
        service is unhealthy, a new batch is refused with ServiceUnavailable; while only the
        storage fails (a database locked by another process), the write itself decides
        (StorageUnavailable if it still fails).

        The batch belongs to the caller's tenant, and its input file must be one the caller sees
        (else NotFound, as for a file that does not exist). Over the tenant's own limits the call
        raises IntakeFull naming that limit.

        ``retry_of`` names the batch this one retries (``batches.retry``); ``idempotency_call``
        then replaces the fingerprint of this call's arguments with the retry call's, and
        ``new_input`` is its new input file (in place on disk, not recorded yet): its record is
        made in the same write as the batch's row, so a crash leaves both or neither.
        """
        parts = self.parts
        parameters = parameters or BatchParameters()
        order = self.settings.output_order if output_order is None else check_output_order(output_order)
        call = idempotency_call or fingerprint(
            input_file_id,
            endpoint,
            completion_window,
            metadata,
            parameters.to_dict(),
            output_expires_after_s,
            *(() if order == COMPLETION else (order,)),  # fingerprints of earlier keys stay the same
        )
        if idempotency_key is not None:
            earlier = await parts.ledger.replay(idempotency_key, "batch", call, caller.tenant)
            if earlier is not None:
                return await self.get_batch(earlier, caller=caller)
        async with parts.calls.one_at_a_time():  # from the file's check to the batch's row
            health = self.health()
            # Only the storage failing (another process holds the database locked, a full disk): the
            # write below says whether it works now (else 503 storage_unavailable, or 507 when full).
            if not health.healthy and self._storage_fault() is None:
                raise ServiceUnavailable(
                    f"The server is unhealthy and accepts no new batch until it recovers: {health.reason}",
                    retry_after_s=self.settings.unhealthy_retry_after_s,
                )
            if endpoint not in SUPPORTED_ENDPOINTS:
                raise InvalidRequest(
                    f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}, got {endpoint!r}",
                    param="endpoint",
                    code="invalid_value",  # OpenAI's code for it
                )
            window_s = parse_completion_window(completion_window)
            metadata = check_metadata(metadata)
            self.webhooks.check_metadata(metadata)
            check_parameters(parameters)
            check_output_expiry(output_expires_after_s)
            file = new_input or (
                await parts.calls(self.metadata.get_file, input_file_id)
                if isinstance(input_file_id, str)
                else None
            )
            if file is None or not caller.sees(file.owner):
                # the guide's error table: an unknown file in a create is bad input (400)
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
            for other in await parts.calls(self.metadata.batches_using_file, file.id):
                tracked = parts.tracker.get(other.id)
                if tracked is not None:
                    other = tracked.batch  # its status now, saved or not
                if other.input_file_id == file.id and other.status.is_active:
                    raise InvalidRequest(
                        f"Batch '{other.id}' is already running on file '{file.id}'; "
                        "wait for it to finish before submitting the file again.",
                        param="input_file_id",
                    )
            self._check_tenant_limits(caller, file.line_count)
            served = self._model_of_file(file, endpoint, await self._local_path(file))
            fits_ever = file.line_count <= self.intake_pool.capacity
            if self.replica is None and fits_ever and file.line_count > self.intake_pool.free:
                raise IntakeFull(
                    f"The server is at capacity: {self.intake_pool.free} of {self.intake_pool.capacity} intake "
                    f"slots are free and this batch has {file.line_count} requests. Retry later.",
                    retry_after_s=self.intake_pool.retry_after_s(file.line_count),
                )
            created_s = exact_now()  # the window counts from here, not from the whole second
            created = int(created_s)
            batch = Batch(
                id=new_object_id("batch_"),
                endpoint=endpoint,
                input_file_id=file.id,
                completion_window=completion_window,
                status=BatchStatus.VALIDATING,
                created_at=created,
                expires_at=deadline(created_s, window_s),
                model=served.public_name,
                parameters=parameters,
                metadata=metadata,
                output_expires_after_s=output_expires_after_s,
                request_counts=RequestCounts(total=file.line_count),
                owner=caller.tenant,
                retry_of=retry_of,
                output_order=order,
            )
            entry = parts.ledger.entry(idempotency_key, "batch", call, created, caller.tenant)
            if self.replica is not None:  # admitted against what every replica holds, and shared
                return await self._share(self.replica, batch, entry, caller, new_input)
            # Admission is atomic: the batch's places are held from now until the starter queues it
            # (or it ends first), so every batch answered here is queued in full. A batch larger than
            # the whole pool holds nothing; the starter fails it with capacity_exceeded.
            if fits_ever:
                self.intake_pool.reserve(batch.id, file.line_count, caller.tenant)
            try:
                # the row and its key in one step: a failure (a full disk) records neither, and
                # nothing is tracked before the row exists
                await parts.calls(
                    self.metadata.insert_batch,
                    batch,
                    idempotency=entry,
                    files=() if new_input is None else (new_input,),
                )
            except BaseException:
                self.intake_pool.release(batch.id)
                raise
            active = parts.tracker.track(batch)
            log_created(batch)
            self._spawn(parts.starter.start, active, file)
            return active.snapshot()

    async def _share(
        self,
        replica: ReplicaWork,
        batch: Batch,
        entry: IdempotencyRecord | None,
        caller: Caller,
        new_input: FileObject | None,
    ) -> Batch:
        """Hand a new batch to every replica (``SharedBatches.share``), admitted against what all
        of them hold: the intake, and the tenant's queued requests and running batches. A retry's
        ``new_input`` is recorded with it."""
        from batchgen.core.work.intake import IntakeFull as GlobalIntakeFull
        from batchgen.core.work.intake import IntakeLimits

        limits = IntakeLimits(
            capacity=self.settings.max_intake_capacity,
            tenant_queued=caller.limits.max_queued_requests,
            tenant_active=caller.limits.max_active_batches,
        )
        try:
            shared = await replica.batches.share(
                batch, idempotency=entry, limits=limits, weight=caller.limits.weight, new_input=new_input
            )
        except GlobalIntakeFull as exc:
            raise IntakeFull(f"{exc} Retry later.", retry_after_s=SHARED_INTAKE_RETRY_AFTER_S) from None
        log_created(shared)
        return shared

    def _check_tenant_limits(self, caller: Caller, requests: int) -> None:
        """IntakeFull, naming the tenant's limit, when a batch of ``requests`` would exceed it now;
        InvalidRequest (400, no retry helps) when it exceeds the limit itself."""
        limits, tenant = caller.limits, caller.tenant
        never_fits = limits.never_fits(tenant, requests)
        if never_fits is not None:
            raise InvalidRequest(never_fits, param="input_file_id", code="capacity_exceeded")
        if limits.max_active_batches is not None:
            active = sum(
                1 for batch in self.parts.tracker if batch.batch.owner == tenant and batch.status.is_active
            )
            if active >= limits.max_active_batches:
                raise IntakeFull(
                    f"Tenant '{tenant}' has {active} active batches; its limit (max_active_batches) is "
                    f"{limits.max_active_batches}. Retry when one of them has ended.",
                    retry_after_s=self.intake_pool.drain.wait_for(
                        max(1, self.intake_pool.queued_for_tenant(tenant))
                    ),
                )
        if limits.max_queued_requests is not None:
            queued = self.intake_pool.queued_for_tenant(tenant)
            if queued + requests > limits.max_queued_requests:
                raise IntakeFull(
                    f"Tenant '{tenant}' has {queued} requests queued and this batch has {requests}; "
                    f"its limit (max_queued_requests) is {limits.max_queued_requests}. Retry later.",
                    retry_after_s=self.intake_pool.drain.wait_for(
                        queued + requests - limits.max_queued_requests
                    ),
                )

    async def _local_path(self, file: FileObject) -> str:
        """A local path holding a stored file's bytes: its own, or, for a replica whose files
        live in an object store, its copy (fetched from the store when it has none). A file
        whose bytes are gone gives its recorded path (reading it then fails as it would)."""
        if self.replica is None:
            return file.path
        with storage_faults_as_errors("read the input file"):
            try:
                return os.fspath(await anyio.to_thread.run_sync(self.blobs.readable, file.path))
            except FileNotFoundError:
                return file.path

    def _model_of_file(self, file: FileObject, endpoint: str, path: str) -> ServedModel:
        """The model a batch over ``file`` (its bytes at ``path``) runs on; InvalidRequest if it
        cannot serve ``endpoint`` (the models changed since the upload), ServiceUnavailable while
        it is unhealthy."""
        try:
            served = self.model_set.route(first_line_model(path)).model
        except (InvalidRequest, OSError) as exc:
            message = exc.message if isinstance(exc, InvalidRequest) else str(exc)
            raise InvalidRequest(f"Line 1 of file '{file.id}': {message}", param="input_file_id") from None
        if not served.capabilities.serves(endpoint):
            raise InvalidRequest(
                f"Line 1 of file '{file.id}': model {served.public_name!r} does not serve {endpoint}; "
                f"it serves {', '.join(served.capabilities.served_endpoints)}",
                param="endpoint",
            )
        health = served.health()
        if not health.healthy and len(self.model_set) > 1:
            raise ServiceUnavailable(
                f"Model {served.public_name!r} is unavailable and accepts no new batch: {health.reason}",
                retry_after_s=self.settings.unhealthy_retry_after_s,
            )
        return served

    @_storage_call("read the batch")
    async def get_batch(self, batch_id: str, *, caller: Caller = EMBEDDED) -> Batch:
        active = self.parts.tracker.get(batch_id)
        batch = (
            active.snapshot()
            if active is not None
            else await self.parts.calls(self.metadata.get_batch, batch_id)
        )
        if batch is None or not caller.sees(batch.owner):
            raise NotFound(f"No batch with id '{batch_id}'.")
        if self.replica is not None:
            batch = await self.replica.batches.view(batch)
        return (await with_retries(self, [batch]))[0]

    @_storage_call("list the batches")
    async def list_batches(
        self, *, after: str | None = None, limit: int = 20, order: str = "desc", caller: Caller = EMBEDDED
    ) -> tuple[list[Batch], bool]:
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be between 1 and 100", param="limit")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
        tracker = self.parts.tracker
        batches, has_more = await self.parts.calls(
            self.metadata.list_batches,
            after=after,
            limit=limit,
            descending=order == "desc",
            owner=caller.owner_filter,
        )
        live = [active.snapshot() if (active := tracker.get(batch.id)) else batch for batch in batches]
        if self.replica is not None:
            live = [await self.replica.batches.view(batch) for batch in live]
        return await with_retries(self, live), has_more

    @_storage_call("retry the batch")
    async def retry_batch(
        self,
        batch_id: str,
        request: RetryRequest | None = None,
        *,
        idempotency_key: str | None = None,
        caller: Caller = EMBEDDED,
    ) -> Batch:
        """A new batch over the lines of an ended batch that did not succeed (``batches.retry``)."""
        return await self.retries.retry(
            batch_id, request or RetryRequest(), idempotency_key=idempotency_key, caller=caller
        )

    @_storage_call("read the merged results")
    async def merged_results(self, batch_id: str, *, caller: Caller = EMBEDDED) -> FamilyIndex:
        """The best result so far of every request of a batch and its retries (``result_merge``);
        the caller reads it (``merged_chunks``, in a worker thread) and closes it."""
        return (await self.retries.index(batch_id, caller))[1]

    @_storage_call("cancel the batch")
    async def cancel_batch(self, batch_id: str, *, caller: Caller = EMBEDDED) -> Batch:
        """Drop the batch's queued requests at once and abort those in flight. Cancelling a batch
        that is already cancelling or cancelled returns it as it is (a cancel retried after a
        timeout is no error); a batch that ended otherwise is a Conflict."""
        active = self.parts.tracker.get(batch_id)
        if active is not None and not caller.sees(active.batch.owner):
            raise NotFound(f"No batch with id '{batch_id}'.")
        if active is None:
            batch = await self.get_batch(batch_id, caller=caller)
            if batch.status in _CANCELLED_OR_CANCELLING:
                return batch
            if self.replica is not None and not batch.status.is_terminal:
                return await self.replica.batches.cancel(batch)  # on every replica
            raise Conflict(f"Batch '{batch_id}' is {batch.status.value} and cannot be cancelled.")
        if active.status in _CANCELLED_OR_CANCELLING:
            return active.snapshot()
        if active.status.is_terminal:  # ended; its status is still being saved
            raise Conflict(f"Batch '{batch_id}' has ended and cannot be cancelled.")
        if active.status is BatchStatus.FINALIZING:
            raise Conflict(f"Batch '{batch_id}' is finalizing and cannot be cancelled.")
        self.parts.tracker.cancel(active)
        await self.parts.tracker.wait_saved(active)  # answered with the status as saved
        return active.snapshot()

    async def wait_for_batch(self, batch_id: str, *, poll_interval: float = 0.05) -> Batch:
        """Wait until the batch reaches a terminal status and return it (for pipelines and tests).

        Raises ServiceUnavailable if the service's core stops meanwhile.
        """
        while True:
            if self.supervisor.crashed:
                raise ServiceUnavailable(f"The batch service has stopped: {self.supervisor.reason()}")
            batch = await self.get_batch(batch_id)
            if batch.status.is_terminal:
                return batch
            await anyio.sleep(poll_interval)

    async def expire_due(self) -> None:
        """End batches past their completion window, and delete files past their expiry.

        Such a batch ends ``failed`` with ``batch_failed`` saying it timed out (the user guide), or
        ``expired`` under OpenAI's convention; either way the lines written so far stay.
        """
        parts = self.parts
        moment = exact_now()
        for active in parts.tracker:
            if not reached(active.batch.expires_at, moment) or active.status not in (
                BatchStatus.VALIDATING,
                BatchStatus.IN_PROGRESS,
            ):
                continue
            if self.settings.error_file == "openai":
                parts.tracker.expire(active)
            else:
                batch = active.batch
                parts.tracker.fail(
                    active,
                    "batch_failed",
                    f"The batch timed out: it did not finish within its completion window of "
                    f"{batch.completion_window} ({parse_completion_window(batch.completion_window)} s). "
                    f"{active.finished} of {batch.request_counts.total} requests finished "
                    f"({active.completed} completed, {active.failed} failed); their lines are kept "
                    "in the output file.",
                )
        await parts.files.delete_expired()
        parts.uploads.expire_due()

    # --- monitoring -----------------------------------------------------------------------
    def pool_status(self) -> PoolStatus:
        counted = self.telemetry  # requests whose line was written since the process started
        admitted = self.scheduling_pool.active
        engines = combined_activity(model.backend for model in self.model_set)
        running = None if engines.running is None else min(admitted, max(0, engines.running))
        generated, counted_as = engines.generated_tokens, "as_generated"
        if generated is None:
            generated, counted_as = counted.generated_tokens, "when_finished"
        requests_rate, tokens_rate = counted.throughput.read(counted.completed + counted.failed, generated)
        if admitted == 0 and self.intake_pool.size == 0:  # nothing queued or running: no rate now
            requests_rate = tokens_rate = 0.0  # (and an idle server's status stays the same: 304s)
        return PoolStatus(
            intake_pool_size=self.intake_pool.size,
            intake_pool_capacity=self.intake_pool.capacity,
            scheduling_pool_active=admitted,
            scheduling_pool_free=self.scheduling_pool.free,
            scheduling_pool_capacity=self.scheduling_pool.capacity,
            active_batches=0 if self._parts is None else len(self._parts.tracker),
            requests_completed_total=counted.completed,
            requests_failed_total=counted.failed,
            prompt_tokens_total=counted.prompt_tokens,
            completion_tokens_total=counted.generated_tokens,
            engine_running=running,
            engine_waiting=None if running is None else admitted - running,
            engines=tuple(
                {"model": model.public_name, **attrs.asdict(activity_of(model.backend))}
                for model in self.model_set
            ),
            generated_tokens_total=generated,
            generated_tokens_counted=counted_as,
            requests_per_second=round(requests_rate, 3),
            tokens_per_second=round(tokens_rate, 2),
            rate_time_constant_s=counted.throughput.time_constant_s,
            replicas=None if self.replica is None else tuple(self.replica.fleet),
        )

    @property
    def running(self) -> bool:
        """Whether the service is started (and not stopped yet)."""
        return self._parts is not None

    def active_batch_statuses(self) -> dict[BatchStatus, int]:
        """How many unfinished batches are in each status (as callers see them)."""
        counts: dict[BatchStatus, int] = {}
        for active in [] if self._parts is None else self._parts.tracker:
            status = active.snapshot().status
            counts[status] = counts.get(status, 0) + 1
        return counts

    def batches_at_risk(self) -> int:
        """Running batches whose pace says they will not finish by their deadline (``deadline_watch``)."""
        return 0 if self._parts is None else self._parts.deadlines.at_risk()

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share of the slots while other tenants have queued work too (default 1)."""
        self.intake_pool.set_weight(tenant, weight)

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """The limits set on every tenant (the API keys' store, at each reload): each tenant's weight,
        and the limits that apply when an admin acts for a tenant (``tenant_limits``)."""
        self._tenant_limits = dict(limits)
        for tenant, tenant_limits in limits.items():
            self.set_tenant_weight(tenant, tenant_limits.weight)

    def tenant_limits(self, tenant: str) -> TenantLimits:
        """The limits set on ``tenant`` (none set: no limit)."""
        return self._tenant_limits.get(tenant, TenantLimits())

    def caller_as_owner(self, caller: Caller, owner: str) -> Caller:
        """The caller acting for ``owner``: itself when it is that tenant, else (an admin) the owner's
        tenant under the owner's limits, so what it makes for the owner counts against them."""
        if caller.tenant == owner:
            return caller
        return attrs.evolve(caller, tenant=owner, limits=self.tenant_limits(owner))

    def tenant_status(self, caller: Caller = EMBEDDED) -> list[dict[str, Any]]:
        """Per tenant with work: requests queued and running, batches not ended, and its weight.

        An admin sees every tenant; any other caller only its own.
        """
        queued = self.intake_pool.tenants_queued()
        running: Counter[str] = Counter()
        batches: Counter[str] = Counter()
        if self._parts is not None:
            for active in self._parts.tracker:
                batches[active.batch.owner] += 1
                running[active.batch.owner] += self.scheduling_pool.active_for(active.id)
        tenants = sorted(set(queued) | set(batches)) if caller.admin else [caller.tenant]
        return [
            {
                "tenant": tenant,
                "queued_requests": queued.get(tenant, 0),
                "running_requests": running[tenant],
                "active_batches": batches[tenant],
                "weight": self.intake_pool.weight(tenant),
            }
            for tenant in tenants
        ]

    @_storage_call("read the usage")
    async def usage(self, *, caller: Caller = EMBEDDED) -> list[TenantUsage]:
        """Per tenant: batches, finished requests and tokens over all time (an admin sees every
        tenant, any other caller its own). Saved figures plus what running batches did since
        their last save, so nothing is written per request."""
        saved = {
            usage.tenant: usage for usage in await self.parts.calls(self.metadata.usage, caller.owner_filter)
        }
        for active in self.parts.tracker:
            owner, last = active.batch.owner, active.saved
            if last is None or not caller.sees(owner):
                continue
            base = saved.get(owner) or TenantUsage(owner, batches=1)
            saved[owner] = attrs.evolve(
                base,
                completed_requests=base.completed_requests + active.completed - last.request_counts.completed,
                failed_requests=base.failed_requests + active.failed - last.request_counts.failed,
                prompt_tokens=base.prompt_tokens + active.prompt_tokens - last.usage.prompt_tokens,
                completion_tokens=base.completion_tokens
                + active.completion_tokens
                - last.usage.completion_tokens,
            )
        if not caller.admin and caller.tenant not in saved:
            saved[caller.tenant] = TenantUsage(caller.tenant)
        return [saved[tenant] for tenant in sorted(saved)]

    def health(self) -> Health:
        if self._parts is None:
            return Health(False, "the batch service is not running")
        if self.supervisor.crashed:
            return Health(False, f"the batch service has stopped: {self.supervisor.reason()}")
        held = self._parts.executor.held
        if held.fault is not None:
            return Health(
                False,
                f"storage unavailable: work is paused, {held.lines} result lines wait for the "
                f"storage: {held.fault.message}",
            )
        failing = self.maintenance.failing()
        if failing:
            problems = "; ".join(f"{name}: {error}" for name, error in failing.items())
            if self._storage_fault() is not None:  # every failing job waits for the storage
                return Health(False, f"storage unavailable: {problems}")
            return Health(False, f"background job failing: {problems}")
        if self.replica is not None and not self.replica.runner.healthy:
            return Health(False, f"shared work failing: {'; '.join(self.replica.runner.problems)}")
        return self.model_set.health()

    def _storage_fault(self) -> StorageUnavailable | None:
        """The storage fault that every failing maintenance job, and the work paused on held
        result lines, waits on (a database another process holds locked, a full disk), or None
        when nothing waits on one or something fails otherwise."""
        failing = self.maintenance.failing()
        faults = self.maintenance.storage_faults()
        if failing and not set(failing) <= set(faults):
            return None
        if failing:
            return faults[next(iter(failing))]
        return None if self._parts is None else self._parts.executor.held.fault

    def health_report(self) -> dict[str, Any]:
        """``GET /health``'s body: the status, and with several models each model's state.

        With several models the service is healthy while at least one model is; the others are
        listed as unavailable with the reason, and only their batches are refused. A replica adds
        its share of the work: its id, the shards it holds, the lines it committed, the leases it
        lost and the commits refused to it.
        """
        report = self.health().to_dict()
        if len(self.model_set) > 1 and self._parts is not None and not self.supervisor.crashed:
            states = {model.public_name: model.health() for model in self.model_set}
            if report["status"] == "healthy" and not all(state.healthy for state in states.values()):
                report["status"] = "degraded"
            report["models"] = {name: state.to_dict() for name, state in states.items()}
        if self.replica is not None:
            report["replica"] = self.replica.report()
        return report

    def accepted_model_names(self) -> tuple[str, ...]:
        """What a request's ``model`` field may name: every model's names, and "default"."""
        return self.model_set.accepted_names()

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: each served model under each name it answers to, its backend and
        the endpoints it serves (the default model first)."""
        entries: dict[str, dict[str, Any]] = {}
        for model in self.model_set:
            entry = model.describe(self._started_at)
            for name in model.names:
                entries.setdefault(name, {**entry, "id": name})  # a name routes to its first model
        return list(entries.values())

    def model(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{name}``: the entry ``models`` lists under ``name``; NotFound if no
        served model answers to it."""
        for entry in self.models():
            if entry["id"] == name:
                return entry
        raise NotFound(f"No model named '{name}' is served here.", param="model", code="model_not_found")


def _sync_all(writers: list[ResultWriter]) -> None:
    """fsync every writer; a writer closed meanwhile was synced by its close. Raise the first error
    once all were tried, so the maintenance job reports it."""
    first_error: OSError | None = None
    for writer in writers:
        try:
            writer.sync()
        except ValueError:
            continue
        except OSError as exc:
            if exc.errno != errno.EBADF:  # EBADF: closed (and synced) while this thread ran
                first_error = first_error or exc
    if first_error is not None:
        raise first_error
