"""What a storage implementation must provide: the metadata store, the blob store, the result writer.

The service talks to storage only through these three protocols. The server's implementation is
SQLite (``SQLiteMetadataStore``) and the local filesystem (``LocalBlobStore``, ``OutputWriter``);
``PostgresMetadataStore`` (for several servers sharing one database) passes the same contract
tests, ``tests/core/test_storage_contract.py``.

Calls are synchronous. The service makes them through ``storage.metadata_calls.MetadataCalls``:
in place for a store on the local disk, in worker threads for a store that sets
``calls_block = True`` (one across a network, whose calls can wait), so that the event loop never
waits on one of its API paths.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import attrs

from batchgen.core.models import Batch, FileObject
from batchgen.core.storage.result_files import FinishedLines
from batchgen.core.tenancy import TenantUsage
from batchgen.core.webhook_outbox import OutboxMessage


@attrs.frozen
class IdempotencyRecord:
    """An ``Idempotency-Key`` to record with the object its call made (scope: "file" or "batch")."""

    key: str
    scope: str
    fingerprint: str
    created_at: int


@runtime_checkable
class MetadataStore(Protocol):
    """Rows for files, batches and idempotency keys, durable once a call returns.

    Lists are in creation order (``descending`` for newest first) and page with ``after``, the id
    of the last object of the previous page; each returns the page and whether more follow. A
    cursor naming a file deleted since still pages on from where that file was; a cursor naming an
    object that never existed raises InvalidRequest (``param="after"``).
    """

    def close(self) -> None:
        """Release the store; no call may follow."""

    def insert_file(self, file: FileObject, *, idempotency: IdempotencyRecord | None = None) -> None:
        """Record a new file; its id must not exist yet. With ``idempotency``, record that key for
        it in the same step: both are recorded or, when the call raises, neither."""

    def get_file(self, file_id: str) -> FileObject | None: ...

    def delete_file(self, file_id: str) -> None:
        """Forget a file; deleting an unknown id is harmless."""

    def expired_files(self, now: int) -> list[FileObject]:
        """Files whose ``expires_at`` is at or before ``now``, oldest first."""

    def list_files(
        self,
        *,
        after: str | None,
        limit: int,
        descending: bool,
        purpose: str | None,
        owner: str | None = None,
    ) -> tuple[list[FileObject], bool]:
        """With ``owner``, only that tenant's files; a cursor naming another's file is refused
        as unknown."""

    def get_idempotency_key(self, key: str) -> tuple[str, str, str] | None:
        """The (scope, fingerprint, object id) recorded for ``key``, or None."""

    def put_idempotency_key(self, key: str, scope: str, fingerprint: str, object_id: str, now: int) -> None:
        """Record a key once; recording an existing key raises."""

    def delete_idempotency_key(self, key: str) -> None:
        """Forget a key (its object is gone); forgetting an unknown key is harmless."""

    def insert_batch(
        self,
        batch: Batch,
        *,
        idempotency: IdempotencyRecord | None = None,
        files: Sequence[FileObject] = (),
    ) -> None:
        """Record a new batch; its id must not exist yet. With ``idempotency``, as ``insert_file``.
        The records of ``files`` (a retry's new input, a shared batch's output file) are made in
        the same step."""

    def save_batch(self, batch: Batch, *, outbox: Sequence[OutboxMessage] = ()) -> None:
        """Overwrite a recorded batch with this state, and add the ``outbox`` messages (its webhook
        event) in the same step: both are saved or, when the call raises, neither. A message whose
        (event id, target) is already there is left as it is."""

    def due_webhooks(
        self, now: float, limit: int, *, skip_targets: Collection[str] = ()
    ) -> list[OutboxMessage]:
        """Up to ``limit`` outbox messages whose ``next_attempt_at`` is at or before ``now``,
        earliest first, leaving out those for ``skip_targets`` (URLs a delivery is in flight to)."""

    def pending_webhooks(self) -> int:
        """How many outbox messages wait for delivery."""

    def reschedule_webhook(self, message: OutboxMessage) -> None:
        """Record a failed attempt: the message's ``attempts``, ``next_attempt_at`` and ``last_error``."""

    def delete_webhook(self, event_id: str, target: str) -> None:
        """Forget a message (delivered, or given up); an unknown one is harmless."""

    def get_batch(self, batch_id: str) -> Batch | None: ...

    def list_batches(
        self, *, after: str | None, limit: int, descending: bool = True, owner: str | None = None
    ) -> tuple[list[Batch], bool]:
        """Newest first unless not ``descending``; with ``owner``, as ``list_files``."""

    def active_batches(self) -> list[Batch]:
        """Batches in a non-terminal status, oldest first (what a restart resumes)."""

    def batches_using_file(self, file_id: str) -> list[Batch]:
        """Batches whose input, output or error file is ``file_id``."""

    def retries_of(self, batch_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """For each of ``batch_ids`` that has retries, the ids of the batches whose ``retry_of``
        names it, oldest first."""

    def retry_family(self, batch_id: str) -> list[str]:
        """``batch_id`` and its retries, theirs, and so on: every batch of its family, oldest first
        (empty when no such batch is stored)."""

    def usage(self, owner: str | None = None) -> list[TenantUsage]:
        """Per owner (or for ``owner`` only): batches, finished requests and tokens, as saved."""


@runtime_checkable
class SharedLocks(Protocol):
    """A metadata store several replicas share offers named locks that all of them see."""

    def try_lock(self, name: str) -> Callable[[], None] | None:
        """Take the lock ``name`` if no replica holds it: the function that lets it go, or None."""


@runtime_checkable
class ResultWriter(Protocol):
    """Appends a batch's result lines, each whole or not at all."""

    path: Path

    @property
    def opened(self) -> bool:
        """Whether a line was written since this writer was made (only those need syncing)."""

    def append(self, line: bytes) -> None:
        """Write one complete line (ending in a newline) at once; on failure raise OSError and
        leave every earlier line intact."""

    def sync(self) -> None:
        """Make every appended line durable (fsync); cheap when nothing is new."""

    def close(self) -> None:
        """Sync and close; appending afterwards raises ValueError; closing twice is harmless."""


@runtime_checkable
class BlobStore(Protocol):
    """Where file contents live: uploads, result files, and uploads still being received."""

    def upload_path(self, file_id: str) -> Path:
        """Where a validated upload is kept."""

    def output_path(self, batch_id: str) -> Path:
        """A batch's output file (one line per finished request)."""

    def error_path(self, batch_id: str) -> Path:
        """A batch's separate error file."""

    def new_staging_path(self) -> Path:
        """A fresh path to receive an upload into before it is validated."""

    def clear_staging(self) -> None:
        """Remove uploads a previous run left half received."""

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Delete a file's contents; a missing one is harmless."""

    def publish(self, path: Path) -> None:
        """Make a validated upload, in place at ``upload_path``, readable by every replica (a put
        to the object store; nothing for a local folder). It may wait on the network."""

    def readable(self, path: str) -> Path:
        """A local path holding the bytes of the stored file recorded at ``path`` (a copy fetched
        from the object store; the path itself for a local folder). It may wait on the network."""

    def open_result_writer(self, path: Path) -> ResultWriter:
        """A writer appending to ``path`` (opened on its first line)."""

    def read_finished(self, path: Path) -> FinishedLines:
        """What the complete lines of a result file record, first cutting off a torn last line."""
