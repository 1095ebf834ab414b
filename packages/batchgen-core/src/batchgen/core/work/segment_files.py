"""SegmentFiles: output segments as files on a filesystem every replica mounts (``file:///...``).

A replica holding shard ``s`` of a batch at epoch ``e`` writes what it finished as segments:

    {root}/segments/{batch_id}/{kind}/{s}/{e}-{n}.jsonl

Each key is written once, by one writer (the shard's owner at that epoch; ``n`` counts its
segments), with ``O_EXCL``: a second write of a key fails instead of overwriting it, so committed
bytes can never change. The file is fsynced, and so is its folder, before ``write`` returns; only
then may the writer commit it to the ledger. Readers go by the manifest alone: a segment is
served only once committed, and only its committed ``size`` bytes. A zombie replica can write
keys of its own old epoch, but its commit is refused, so those bytes are never served; ``orphans``
finds such files (not in the manifest, older than a grace period) for ``collect`` to delete.

Several writers never append to one file (NFS does not keep appends from two clients apart), and
a torn tail past the committed size needs no repair: nothing reads it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from batchgen.core.storage.durable_folders import sync_folder
from batchgen.core.work.shards import SEGMENT_KINDS, Segment

__all__ = ["SegmentFiles", "SegmentMissing"]

#: Batch ids as BatchGen makes them; anything else in a key could leave the segments folder.
_BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_READ_CHUNK = 1 << 20


class SegmentMissing(OSError):
    """A committed segment's file is missing or shorter than its committed size."""


class SegmentFiles:
    """Segments under ``root``/segments."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.segments_dir = root / "segments"
        self.segments_dir.mkdir(parents=True, exist_ok=True)

    # --- writing --------------------------------------------------------------------------

    @staticmethod
    def key(batch_id: str, kind: str, shard_no: int, epoch: int, number: int) -> str:
        """The object key of a writer's ``number``-th segment of a shard at ``epoch``."""
        if not _BATCH_ID.fullmatch(batch_id):
            raise ValueError(f"not a batch id: {batch_id!r}")
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"a segment holds one of {SEGMENT_KINDS}, not {kind!r}")
        if min(shard_no, epoch, number) < 0:
            raise ValueError("shard numbers, epochs and segment numbers are not negative")
        return f"segments/{batch_id}/{kind}/{shard_no}/{epoch}-{number}.jsonl"

    def write(self, key: str, data: bytes) -> int:
        """Write a new segment and make it durable; its size. FileExistsError if the key exists."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        sync_folder(path.parent)
        return len(data)

    # --- reading --------------------------------------------------------------------------

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

    def _read_part(self, segment: Segment, start: int, end: int) -> Iterator[bytes]:
        try:
            with self._path(segment.object_key).open("rb") as file:
                file.seek(start)
                left = end - start
                while left:
                    chunk = file.read(min(left, _READ_CHUNK))
                    if not chunk:
                        raise SegmentMissing(
                            f"{segment.object_key} is shorter than its committed {segment.size} bytes"
                        )
                    left -= len(chunk)
                    yield chunk
        except FileNotFoundError as missing:
            raise SegmentMissing(f"committed segment {segment.object_key} is missing") from missing

    # --- collection -----------------------------------------------------------------------

    def keys(self) -> Iterator[str]:
        """Every segment key on disk."""
        for path in self.segments_dir.rglob("*.jsonl"):
            yield path.relative_to(self.root).as_posix()

    def orphans(self, committed: Iterable[str], grace_s: float, now: float | None = None) -> list[str]:
        """Segment files the manifest does not list and not touched for ``grace_s`` seconds:
        written by a writer that died or was fenced out before (or instead of) committing. The
        grace period keeps a live writer's segment, written but not committed yet."""
        keep = set(committed)
        cutoff = (time.time() if now is None else now) - grace_s
        found = []
        for key in self.keys():
            if key in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                if self._path(key).stat().st_mtime < cutoff:
                    found.append(key)
        return sorted(found)

    def collect(self, keys: Iterable[str]) -> int:
        """Delete the given (orphaned) segment files; how many were removed."""
        removed = 0
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
                removed += 1
        return removed

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.segments_dir.resolve()):
            raise ValueError(f"segment key {key!r} is outside the segments folder")
        return path
