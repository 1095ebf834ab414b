"""S3Segments: output segments as objects in any S3-compatible store (``s3://BUCKET/PREFIX?...``).

The keys and the rules are ``segment_store``'s; here a key is an object under the URL's prefix.
A segment is written with one conditional ``PutObject`` (``If-None-Match: *``): the store refuses
a second write of a key (412), so committed bytes never change, and a put that returned is
durable. Reads are ranged ``GET``s of committed sizes only; orphans are found by listing.

The client and the URL (``s3://bucket/prefix?endpoint=...&region=...``, credentials from the
``AWS_*`` variables) are ``storage.s3_objects``'s. Its calls are synchronous; the shard runner calls
``write`` in a worker thread, so the event loop never waits on the network.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import S3Store

from batchgen.core.storage.s3_objects import open_s3_store
from batchgen.core.work.segment_store import SEGMENTS_PREFIX, SegmentMissing, SegmentStore
from batchgen.core.work.shards import Segment

__all__ = ["S3Segments"]


class S3Segments(SegmentStore):
    """Segments under ``prefix`` in ``bucket``."""

    def __init__(self, store: S3Store, description: str) -> None:
        self._store = store
        self._description = description

    def __repr__(self) -> str:
        return f"S3Segments({self._description!r})"

    @classmethod
    def from_url(cls, url: str, environ: Mapping[str, str] | None = None) -> S3Segments:
        """The store an ``s3://`` URL names (``storage.s3_objects``); ValueError saying what is
        wrong with any other."""
        return cls(*open_s3_store(url, environ))

    def write(self, key: str, data: bytes) -> int:
        _check(key)
        try:
            obstore.put(self._store, key, data, mode="create")
        except AlreadyExistsError as exists:
            raise FileExistsError(f"segment {key} exists already") from exists
        return len(data)

    def _read_part(self, segment: Segment, start: int, end: int) -> Iterator[bytes]:
        _check(segment.object_key)
        try:
            data = bytes(obstore.get_range(self._store, segment.object_key, start=start, end=end))
        except (NotFoundError, FileNotFoundError) as missing:
            raise SegmentMissing(f"committed segment {segment.object_key} is missing") from missing
        if len(data) != end - start:
            raise SegmentMissing(f"{segment.object_key} is shorter than its committed {segment.size} bytes")
        yield data

    def _read_whole(self, key: str) -> bytes | None:
        _check(key)
        try:
            return bytes(obstore.get(self._store, key).bytes())
        except (NotFoundError, FileNotFoundError):
            return None

    def _stored_size(self, key: str) -> int | None:
        _check(key)
        try:
            return int(obstore.head(self._store, key)["size"])
        except (NotFoundError, FileNotFoundError):
            return None

    def _listing(self, under: str = "") -> Iterator[tuple[str, float]]:
        for chunk in obstore.list(self._store, prefix=(SEGMENTS_PREFIX + under).rstrip("/")):
            for meta in chunk:
                yield meta["path"], meta["last_modified"].timestamp()

    def _delete(self, key: str) -> bool:
        _check(key)
        try:
            obstore.delete(self._store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        return True


def _check(key: str) -> None:
    if not key.startswith(SEGMENTS_PREFIX) or ".." in key.split("/"):
        raise ValueError(f"segment key {key!r} is outside the segments prefix")
