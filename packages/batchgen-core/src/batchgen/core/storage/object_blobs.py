"""ObjectBlobStore: uploaded files kept in an S3-compatible store, read through a local copy.

Replicas given ``--blob-url s3://BUCKET/PREFIX?...`` keep every validated upload as one object,
``files/{file_id}.jsonl`` under the prefix, written once with a conditional put (an id is never
written twice, so a file's bytes never change). Each replica keeps copies of the files it needs
in its own storage folder:

    {root}/files/{file_id}.jsonl    a file this replica uploaded, or fetched to read
    {root}/staging/                 uploads being received

An upload is received and validated locally, moved into ``files/`` and then ``publish``-ed (put to
the store) before its row is recorded, so every replica that can see the row can fetch its
bytes. ``readable`` gives a local path to a stored file's bytes, fetching the object into
``files/`` first (a temporary name, then a rename) when this replica has no copy. Deleting a
file deletes the object and this replica's copy; other replicas' copies go at their next start
(the copies are cleared with the staging folder), and nothing serves them meanwhile because the
file's row is gone. Result files are not kept here: in replica mode they are segments
(``work.s3_segments``).

Every call here may wait on the network: the service runs them in worker threads.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import S3Store

from batchgen.core.storage.local_blobs import LocalBlobStore
from batchgen.core.storage.s3_objects import open_s3_store

__all__ = ["FILES_PREFIX", "ObjectBlobStore"]

#: Where the uploaded files live under the store's prefix.
FILES_PREFIX = "files/"
#: The name of a stored file's object and local copy: the file id BatchGen made, then .jsonl.
_STORED_NAME = re.compile(r"file-[A-Za-z0-9]{1,64}\.jsonl")
#: Objects are fetched in pieces of this size into the local copy.
_FETCH_CHUNK = 8 << 20


class ObjectBlobStore(LocalBlobStore):
    """Uploads as objects of ``store``, with local copies and staging under ``root``."""

    def __init__(self, store: S3Store, description: str, root: Path) -> None:
        super().__init__(root)
        self._store = store
        self._description = description

    def __repr__(self) -> str:
        return f"ObjectBlobStore({self._description!r}, {str(self.root)!r})"

    @classmethod
    def from_url(cls, url: str, root: Path, environ: Mapping[str, str] | None = None) -> ObjectBlobStore:
        """The store an ``s3://`` URL names (``storage.s3_objects``), with its local copies under
        ``root``; ValueError for a bad URL."""
        store, description = open_s3_store(url, environ)
        return cls(store, description, root)

    def clear_staging(self) -> None:
        """Remove half-received uploads, and the copies of stored files (fetched again when read)."""
        super().clear_staging()
        for copy in self.files_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                copy.unlink()

    def publish(self, path: Path) -> None:
        """Put a validated upload, in place at ``upload_path(file_id)``, into the store: once
        this returns, every replica can read it. An object already there is this very file's,
        put by an earlier try (ids are 96 random bits, and a key is only ever created)."""
        key = FILES_PREFIX + _stored_name(path)
        with contextlib.suppress(AlreadyExistsError), path.open("rb") as contents:
            obstore.put(self._store, key, contents, mode="create")

    def readable(self, path: str) -> Path:
        """A local path holding the bytes of the stored file ``path`` names (a copy made by any
        replica: only its name is used), fetched from the store when this replica has none;
        FileNotFoundError if the store has no such object."""
        name = _stored_name(Path(path))
        local = self.files_dir / name
        if local.exists():
            return local
        partial = self.files_dir / f".{name}.{secrets.token_hex(6)}.fetching"
        try:
            try:
                result = obstore.get(self._store, FILES_PREFIX + name)
            except (NotFoundError, FileNotFoundError) as missing:
                raise FileNotFoundError(f"{FILES_PREFIX}{name} is not in {self._description}") from missing
            with partial.open("wb") as copy:
                for chunk in result.stream(min_chunk_size=_FETCH_CHUNK):
                    copy.write(chunk)
            os.replace(partial, local)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return local

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Delete a staging file; or, for a stored file (whichever replica's copy ``path``
        names), its object and this replica's copy."""
        name = Path(path).name
        if not _STORED_NAME.fullmatch(name):
            super().remove(path)
            return
        with contextlib.suppress(FileNotFoundError):
            (self.files_dir / name).unlink()
        with contextlib.suppress(NotFoundError, FileNotFoundError):
            obstore.delete(self._store, FILES_PREFIX + name)


def _stored_name(path: Path) -> str:
    if not _STORED_NAME.fullmatch(path.name):
        raise ValueError(f"{path.name!r} is not the name of a stored file")
    return path.name
