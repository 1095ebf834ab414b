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

``SegmentStore`` is the base of the two stores: ``segment_files.SegmentFiles`` (a filesystem every
replica mounts) and ``s3_segments.S3Segments`` (any S3-compatible object store). A store supplies
``write``, ``_read_part``, ``_listing`` and ``_delete``; the rest is here. ``open_segment_store``
picks one from a blob URL (``file:///folder`` or ``s3://bucket/prefix?endpoint=...``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from batchgen.core.work.shards import SEGMENT_KINDS, Segment

__all__ = ["SegmentMissing", "SegmentStore", "open_segment_store", "segment_key"]

#: Batch ids as BatchGen makes them; anything else in a key could leave the segments prefix.
_BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: Where every segment lives, under a store's root or prefix.
SEGMENTS_PREFIX = "segments/"


class SegmentMissing(OSError):
    """A committed segment is missing or shorter than its committed size."""


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

    def write(self, key: str, data: bytes) -> int:
        """Store a new segment durably; its size. FileExistsError if the key exists."""
        raise NotImplementedError

    def _read_part(self, segment: Segment, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` .. ``end`` of one segment; SegmentMissing if it has fewer."""
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

    def keys(self) -> Iterator[str]:
        """Every segment key in the store."""
        return (key for key, _ in self._listing())

    def written(self, batch_id: str, kind: str) -> list[str]:
        """Every segment of ``kind`` written for the batch, committed or not."""
        if not _BATCH_ID.fullmatch(batch_id) or kind not in SEGMENT_KINDS:
            raise ValueError(f"not a batch's segments: {batch_id!r}, {kind!r}")
        return sorted(key for key, _ in self._listing(f"{batch_id}/{kind}/"))

    def orphans(self, committed: Iterable[str], grace_s: float, now: float | None = None) -> list[str]:
        """Segments the manifest does not list and not changed for ``grace_s`` seconds: written
        by a writer that died or was fenced out before (or instead of) committing. The grace
        period keeps a live writer's segment, written but not committed yet."""
        keep = set(committed)
        cutoff = (time.time() if now is None else now) - grace_s
        return sorted(key for key, changed in self._listing() if key not in keep and changed < cutoff)

    def collect(self, keys: Iterable[str]) -> int:
        """Delete the given (orphaned) segments; how many were removed."""
        return sum(self._delete(key) for key in keys)


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
