"""Where replicas meet: the settings of a service that shares its state with other replicas.

``SharedStorage`` names ``metadata_url`` (``postgresql://…``: the files, batches, idempotency keys,
work shards and output manifest) and ``blob_url``, where the contents of files live:

- ``file:///folder``: a folder every replica mounts at the same path, holding the uploaded files
  under ``files/``, each replica's uploads being received under ``staging/REPLICA/``, and the
  committed output under ``segments/``;
- ``s3://BUCKET/PREFIX?endpoint=...&region=...``: an S3-compatible object store, holding the
  uploaded files as ``files/`` objects and the output as ``segments/`` objects; each replica
  receives uploads and keeps copies of the files it reads in its own storage folder
  (``storage.object_blobs``).

Reading them needs neither psycopg nor obstore nor a connection: a service that is given them
opens the database and the store itself (``replica_work``).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from batchgen.core.storage.blob_urls import shared_folder
from batchgen.core.work.shards import DEFAULT_LEASE_S, MAX_LEASE_S

__all__ = ["SharedStorage", "shared_folder"]


def _check_metadata_url(_instance: object, _attribute: object, url: str) -> None:
    if urlsplit(url).scheme not in ("postgresql", "postgres"):
        raise ValueError(f"a metadata URL is postgresql://user@host:port/database, not {url!r}")


def _check_blob_url(_instance: object, _attribute: object, url: str) -> None:
    shared_folder(url)


def _check_replica_id(_instance: object, _attribute: object, replica_id: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", replica_id):
        raise ValueError(
            "a replica id is 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a "
            f"digit, not {replica_id!r}"
        )


def _check_lease(_instance: object, _attribute: object, lease_s: float) -> None:
    if not 0 < lease_s <= MAX_LEASE_S:
        raise ValueError(f"a lease lasts more than 0 and at most {MAX_LEASE_S:g} seconds, not {lease_s!r}")


@attrs.frozen
class SharedStorage:
    """Where the replicas share their state (see the module)."""

    metadata_url: str = attrs.field(validator=_check_metadata_url, repr=False)  # it may hold a password
    blob_url: str = attrs.field(validator=_check_blob_url)
    #: This replica's name in the ledger and its staging folder's (each start adds a token).
    replica_id: str = attrs.field(factory=lambda: socket.gethostname()[:64], validator=_check_replica_id)
    #: How long a shard stays with a replica that stopped renewing it (a dead one's wait).
    lease_s: float = attrs.field(default=DEFAULT_LEASE_S, validator=_check_lease)
    #: The fewest shards one replica runs at once (more when its slots need more lines to fill).
    max_shards: int = 4

    @property
    def folder(self) -> Path | None:
        """The shared folder, or None when the contents live in an object store."""
        return shared_folder(self.blob_url)

    @property
    def staging_dir(self) -> Path | None:
        """Where this replica receives uploads in the shared folder (None for an object store:
        then uploads are received in the replica's own storage folder)."""
        folder = self.folder
        return None if folder is None else folder / "staging" / self.replica_id
