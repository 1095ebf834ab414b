"""A tenant's ``max_stored_bytes`` checked and spent in one step, where replicas share a database.

Replicas checking a tenant's stored bytes, then recording a file, at the same moment could each
pass the check, so a store
shared by replicas (``PostgresMetadataStore``) also offers ``insert_file_within_quota``: the sum
and the insert in one transaction, under a lock per tenant, raising ``StoredBytesExceeded``
(with what it found) instead of inserting a file that would pass the limit. The Uploads API's
records do the same for a part (``postgres_uploads``), and count a tenant's open uploads under
the same lock (``OpenUploadsAtLimit``). This module names that offer and its errors, without the
database's driver. A single process admits the bytes under a lock of its own
(``files.stored_bytes_quota``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from batchgen.core.models import FileObject
from batchgen.core.storage.interfaces import IdempotencyRecord


class StoredBytesExceeded(Exception):
    """``adding`` bytes more would take a tenant holding ``used`` past its ``limit``."""

    def __init__(self, used: int, adding: int, limit: int) -> None:
        super().__init__(f"{used} bytes stored, {adding} more would pass {limit}")
        self.used, self.adding, self.limit = used, adding, limit


class OpenUploadsAtLimit(Exception):
    """The tenant already has ``open_now`` open uploads, and ``limit`` is the most it may have."""

    def __init__(self, open_now: int, limit: int) -> None:
        super().__init__(f"{open_now} uploads open, the limit is {limit}")
        self.open_now, self.limit = open_now, limit


@runtime_checkable
class QuotaCheckedFileInserts(Protocol):
    """A metadata store that inserts a file only while its owner stays within a limit."""

    def insert_file_within_quota(
        self, file: FileObject, *, max_stored_bytes: int, idempotency: IdempotencyRecord | None = None
    ) -> None:
        """``insert_file``, unless the bytes the file's owner holds (files and pending upload
        parts) and the file's would pass ``max_stored_bytes``: then StoredBytesExceeded, and
        nothing is written. Checked and written in one step for every replica."""
