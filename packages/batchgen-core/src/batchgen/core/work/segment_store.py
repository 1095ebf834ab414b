"""What every segment store shares: the keys, reading committed bytes by range, finding orphans.

A replica holding shard ``s`` of a batch at epoch ``e`` writes what it finished as segments,
each under its own key:

    segments/{batch_id}/{kind}/{s}/{e}-{n}.jsonl

Each key is written once, by one writer (the shard's owner at that epoch; ``n`` counts its
segments), and a second write of a key fails instead of overwriting it, so committed bytes never
change. Readers go by the ledger's manifest alone: a segment is served only once committed, and
only its committed ``size`` bytes. A zombie replica can write keys of its own old epoch, but its
commit is refused, so those bytes are never served; ``orphans`` finds such objects (not in the
manifest, older than a grace period) for ``collect`` to delete.

A store belongs to one cluster: ``mark_cluster`` writes the cluster's id once, under
``segments/cluster-id``, beside the same id in the cluster's database (``cluster_identity``), and
``probe`` writes, reads back and deletes an object, to show the store is readable and writable.

``SegmentStore`` is the base of the two stores: ``segment_files.SegmentFiles`` (a filesystem every
replica mounts) and ``s3_segments.S3Segments`` (any S3-compatible object store). A store supplies
``write``, ``_read_part``, ``_read_whole``, ``_listing`` and ``_delete``; the rest is here. ``open_segment_store``
picks one from a blob URL (``file:///folder`` or ``s3://bucket/prefix?endpoint=...``).
"""

from __future__ import annotations

import contextlib
import errno
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from batchgen.core.work.shards import SEGMENT_KINDS, Segment

__all__ = ["SegmentMissing", "SegmentStore", "open_segment_store", "segment_batch", "segment_key"]

#: Batch ids as BatchGen makes them; anything else in a key could leave the segments prefix.
_BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: Where every segment lives, under a store's root or prefix.
SEGMENTS_PREFIX = "segments/"
#: The key of the id of the cluster the store belongs to (never a segment: no batch, no .jsonl).
CLUSTER_MARK_KEY = SEGMENTS_PREFIX + "cluster-id"
#: How often a cluster mark still being written is read again.
MARK_REREAD_S = 0.02
#: Where ``probe`` writes its short-lived objects.
PROBE_PREFIX = SEGMENTS_PREFIX + "probes/"
#: A segment key's batch id (``segments/{batch_id}/{kind}/...``).
_SEGMENT_BATCH = re.compile(rf"{SEGMENTS_PREFIX}([A-Za-z0-9_-]{{1,128}})/[a-z]+/\d+/\d+-\d+\.jsonl")


class SegmentMissing(OSError):
    """A committed segment is missing or shorter than its committed size: an I/O error of the
    store (``EIO``), so a read that meets one answers 503 ``storage_unavailable``, never a 500."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


def segment_key(batch_id: str, kind: str, shard_no: int, epoch: int, number: int) -> str:
    """The key of a writer's ``number``-th segment of a shard at ``epoch``."""
    if not _BATCH_ID.fullmatch(batch_id):
        raise ValueError(f"not a batch id: {batch_id!r}")
    if kind not in SEGMENT_KINDS:
        raise ValueError(f"a segment holds one of {SEGMENT_KINDS}, not {kind!r}")
    if min(shard_no, epoch, number) < 0:
        raise ValueError("shard numbers, epochs and segment numbers are not negative")
    return f"{SEGMENTS_PREFIX}{batch_id}/{kind}/{shard_no}/{epoch}-{number}.jsonl"


class SegmentStore:
    """The shared part of a segment store (see the module's docstring)."""

    key = staticmethod(segment_key)
    #: How long ``cluster_mark`` waits for a mark that is being written to be whole.
    mark_write_s = 5.0

    def write(self, key: str, data: bytes) -> int:
        """Store a new segment durably; its size. FileExistsError if the key exists."""
        raise NotImplementedError

    def _read_part(self, segment: Segment, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` .. ``end`` of one segment; SegmentMissing if it has fewer."""
        raise NotImplementedError

    def _read_whole(self, key: str) -> bytes | None:
        """The bytes of a small object (the cluster mark, a probe); None if it is not there."""
        raise NotImplementedError

    def _stored_size(self, key: str) -> int | None:
        """How many bytes the object ``key`` holds; None if it is not there."""
        raise NotImplementedError

    def _listing(self, under: str = "") -> Iterator[tuple[str, float]]:
        """Every segment key (only those under ``segments/{under}``, a folder of keys, when
        given) with its last change, as a Unix time."""
        raise NotImplementedError

    def _delete(self, key: str) -> bool:
        """Delete one segment; False if it was not there."""
        raise NotImplementedError

    def size(self, segments: Sequence[Segment]) -> int:
        """How many bytes the committed segments make, end to end."""
        return sum(segment.size for segment in segments)

    def read(self, segments: Sequence[Segment], start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes ``start`` .. ``end`` (exclusive; None: to the end) of the committed segments
        laid end to end in manifest order, in chunks. Only committed sizes are read."""
        end = self.size(segments) if end is None else end
        offset = 0
        for segment in segments:
            low, high = max(start, offset), min(end, offset + segment.size)
            if low < high:
                yield from self._read_part(segment, low - offset, high - offset)
            offset += segment.size
            if offset >= end:
                return

    def check_readable(self, segments: Sequence[Segment], start: int = 0, end: int | None = None) -> None:
        """SegmentMissing unless every segment holding bytes ``start`` .. ``end`` is stored with at
        least its committed size: checked before a response promises those bytes, so a download
        never stops short of the length it announced."""
        end = self.size(segments) if end is None else end
        offset = 0
        for segment in segments:
            if offset < end and start < offset + segment.size:
                stored = self._stored_size(segment.object_key)
                if stored is None:
                    raise SegmentMissing(f"committed segment {segment.object_key} is missing")
                if stored < segment.size:
                    raise SegmentMissing(
                        f"{segment.object_key} holds {stored} bytes, fewer than its committed {segment.size}"
                    )
            offset += segment.size

    def keys(self) -> Iterator[str]:
        """Every segment key in the store (not the cluster mark, nor a probe)."""
        return (key for key, _ in self._listing() if segment_batch(key) is not None)

    def written(self, batch_id: str, kind: str) -> list[str]:
        """Every segment of ``kind`` written for the batch, committed or not."""
        if not _BATCH_ID.fullmatch(batch_id) or kind not in SEGMENT_KINDS:
            raise ValueError(f"not a batch's segments: {batch_id!r}, {kind!r}")
        return sorted(key for key, _ in self._listing(f"{batch_id}/{kind}/"))

    def orphans(
        self, committed: Iterable[str], known_batches: Iterable[str], grace_s: float, now: float | None = None
    ) -> list[str]:
        """Segments of the batches the ledger knows (``known_batches``) that the manifest does not
        list and that did not change for ``grace_s`` seconds: written by a writer that died or was
        fenced out before (or instead of) committing. The grace period keeps a live writer's
        segment, written but not committed yet. A key of a batch the ledger does not know is never
        an orphan: it is not this ledger's to judge."""
        keep, known = set(committed), set(known_batches)
        cutoff = (time.time() if now is None else now) - grace_s
        return sorted(
            key
            for key, changed in self._listing()
            if key not in keep and changed < cutoff and segment_batch(key) in known
        )

    def cluster_mark(self) -> str | None:
        """The id of the cluster this store belongs to, or None before one was written.

        A mark ends with a newline. One without it is still being written (a filesystem shows
        a file as soon as it is made, before its bytes: a replica starting beside another sees
        that): it is read again until it is whole, for up to ``mark_write_s``, then OSError."""
        deadline = time.monotonic() + self.mark_write_s
        while (data := self._read_whole(CLUSTER_MARK_KEY)) is not None and not data.endswith(b"\n"):
            if time.monotonic() >= deadline:
                raise OSError(
                    f"{self!r}: the cluster mark {CLUSTER_MARK_KEY} holds {data[:80]!r}, no whole id "
                    f"after {self.mark_write_s:g} s (a start that crashed while writing it?): delete "
                    "it if the store holds no segment yet"
                )
            time.sleep(MARK_REREAD_S)
        return None if data is None else data.decode("utf-8", "replace").strip()

    def mark_cluster(self, cluster_id: str) -> str:
        """Write ``cluster_id`` as the store's cluster, unless it has one already; the one it has now."""
        with contextlib.suppress(FileExistsError):
            self.write(CLUSTER_MARK_KEY, cluster_id.encode() + b"\n")
        found = self.cluster_mark()
        if found is None:
            raise OSError(
                f"{self!r}: the cluster mark {CLUSTER_MARK_KEY} was written but cannot be read back"
            )
        return found

    def holds_segments(self) -> bool:
        """Whether any segment was ever written here."""
        return any(segment_batch(key) is not None for key, _ in self._listing())

    def probe(self) -> None:
        """Write a small object, read it back and delete it; OSError saying which step failed."""
        key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        data = f"probe {time.time()}\n".encode()
        self.write(key, data)
        try:
            if self._read_whole(key) != data:
                raise OSError(f"{self!r}: an object written to {key} did not read back the same")
        finally:
            self._delete(key)

    def collect(self, keys: Iterable[str]) -> int:
        """Delete the given (orphaned) segments; how many were removed."""
        return sum(self._delete(key) for key in keys)


def segment_batch(key: str) -> str | None:
    """The batch a segment key belongs to; None for any other key (the cluster mark, a probe)."""
    match = _SEGMENT_BATCH.fullmatch(key)
    return match.group(1) if match else None


def open_segment_store(url: str, environ: Mapping[str, str] | None = None) -> SegmentStore:
    """The store a blob URL names: ``file:///absolute/folder`` (``SegmentFiles``) or
    ``s3://BUCKET/PREFIX?endpoint=...&region=...`` (``S3Segments``, credentials from ``environ``,
    by default the process's environment); ValueError for anything else."""
    scheme = urlsplit(url).scheme
    if scheme == "file":
        from batchgen.core.work.segment_files import SegmentFiles

        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"a file:// blob URL names an absolute local folder: file:///path, not {url!r}")
        return SegmentFiles(Path(unquote(parts.path)))
    if scheme == "s3":
        from batchgen.core.work.s3_segments import S3Segments  # obstore, only when asked for

        return S3Segments.from_url(url, None if environ is None else dict(environ))
    raise ValueError(f"a blob URL is file:///folder or s3://bucket/prefix?endpoint=..., not {url!r}")
