"""Where replicas keep the Uploads API's parts: each part a blob of its own that every replica reads.

A part is received into the receiving replica's staging folder, then ``put`` here, and only then
recorded (``postgres_uploads``): a recorded part's bytes are always where every replica finds
them. Under the blob URL's folder or prefix:

    uploads/{upload_id}/{part_id}

- a shared folder (``FolderPartBlobs``): the received file is renamed there (the staging folder is
  in the shared folder, so nothing is copied; a temporary name, then a rename, where it is not),
  after its bytes reach the disk;
- an S3-compatible store (``ObjectPartBlobs``): the object is put with a conditional create (a
  part's id is never used twice), then the received file is deleted.

``chunks`` reads a part back in pieces (never all of it in memory); ``delete_upload`` deletes an
ended upload's parts, those recorded and any a crash left unrecorded. Every call may wait on the
disk or the network: the service makes them in worker threads.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from batchgen.core.storage.blob_urls import shared_folder
from batchgen.core.storage.local_blobs import move_file

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = ["PART_CHUNK_BYTES", "FolderPartBlobs", "ObjectPartBlobs", "PartBlobs", "open_part_blobs"]

#: Where the parts live under the shared folder or the store's prefix.
UPLOADS_PREFIX = "uploads/"
#: A part is read back this many bytes at a time.
PART_CHUNK_BYTES = 8 << 20
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _key(upload_id: str, part_id: str = "") -> str:
    for name in (upload_id, part_id) if part_id else (upload_id,):
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an upload's or a part's id")
    return f"{UPLOADS_PREFIX}{upload_id}/{part_id}"


class PartBlobs(Protocol):
    def put(self, upload_id: str, part_id: str, received: Path) -> None:
        """Keep the part received whole at ``received`` (consumed) where every replica reads it."""

    def chunks(self, upload_id: str, part_id: str, size: int) -> Iterator[bytes]:
        """The part's ``size`` bytes in pieces; FileNotFoundError if it is gone, OSError if short."""

    def delete_part(self, upload_id: str, part_id: str) -> None:
        """Delete one part (refused after it was put); a missing one is harmless."""

    def delete_upload(self, upload_id: str) -> None:
        """Delete every part of the upload; none there is harmless."""


class FolderPartBlobs:
    """Parts as files under ``root/uploads/`` (the shared folder)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, upload_id: str, part_id: str) -> Path:
        return self.root / _key(upload_id, part_id)

    def put(self, upload_id: str, part_id: str, received: Path) -> None:
        final = self.path(upload_id, part_id)
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(received, "rb") as stream:
            os.fsync(stream.fileno())
        move_file(received, final)

    def chunks(self, upload_id: str, part_id: str, size: int) -> Iterator[bytes]:
        path = self.path(upload_id, part_id)
        with open(path, "rb") as stream:
            left = size
            while left > 0:
                chunk = stream.read(min(PART_CHUNK_BYTES, left))
                if not chunk:
                    raise OSError(f"{path}: {left} bytes of the part are missing")
                left -= len(chunk)
                yield chunk

    def delete_part(self, upload_id: str, part_id: str) -> None:
        self.path(upload_id, part_id).unlink(missing_ok=True)

    def delete_upload(self, upload_id: str) -> None:
        shutil.rmtree(self.root / _key(upload_id), ignore_errors=True)


class ObjectPartBlobs:
    """Parts as objects ``uploads/...`` of an S3-compatible store (under its prefix)."""

    def __init__(self, store: S3Store, description: str) -> None:
        self._store = store
        self._description = description

    def __repr__(self) -> str:
        return f"ObjectPartBlobs({self._description!r})"

    def put(self, upload_id: str, part_id: str, received: Path) -> None:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        with contextlib.suppress(AlreadyExistsError), received.open("rb") as contents:
            obstore.put(self._store, _key(upload_id, part_id), contents, mode="create")
        received.unlink(missing_ok=True)

    def chunks(self, upload_id: str, part_id: str, size: int) -> Iterator[bytes]:
        import obstore
        from obstore.exceptions import NotFoundError

        key = _key(upload_id, part_id)
        try:
            result = obstore.get(self._store, key)
        except (NotFoundError, FileNotFoundError) as missing:
            raise FileNotFoundError(f"{key} is not in {self._description}") from missing
        left = size
        for chunk in result.stream(min_chunk_size=PART_CHUNK_BYTES):
            piece = bytes(chunk)[:left]
            left -= len(piece)
            if piece:
                yield piece
        if left:
            raise OSError(f"{key}: {left} bytes of the part are missing")

    def delete_part(self, upload_id: str, part_id: str) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        with contextlib.suppress(NotFoundError, FileNotFoundError):
            obstore.delete(self._store, _key(upload_id, part_id))

    def delete_upload(self, upload_id: str) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        prefix = _key(upload_id).rstrip("/")
        keys = [meta["path"] for chunk in obstore.list(self._store, prefix=prefix) for meta in chunk]
        for key in keys:
            with contextlib.suppress(NotFoundError, FileNotFoundError):
                obstore.delete(self._store, key)


def open_part_blobs(blob_url: str, environ: Mapping[str, str] | None = None) -> PartBlobs:
    """The parts' store for a replica's ``--blob-url`` (``file://`` a shared folder, ``s3://`` a
    store; ``storage.blob_urls``)."""
    folder = shared_folder(blob_url)
    if folder is not None:
        return FolderPartBlobs(folder)
    from batchgen.core.storage.s3_objects import open_s3_store  # obstore: only here

    return ObjectPartBlobs(*open_s3_store(blob_url, environ))
