"""SegmentFiles: output segments as files on a filesystem every replica mounts (``file:///...``).

The keys and the rules are ``segment_store``'s; here a key is a file under ``root``. A segment is
created with ``O_EXCL`` (a second write of a key fails), and the file is fsynced, and so is its
folder, before ``write`` returns; only then may the writer commit it to the ledger. Another
process can see the file before its bytes: a segment is read only once committed, and
``SegmentStore.cluster_mark`` waits for a mark to be whole.

Several writers never append to one file (NFS does not keep appends from two clients apart), and
a torn tail past the committed size needs no repair: nothing reads it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from batchgen.core.storage.durable_folders import sync_folder
from batchgen.core.work.segment_store import SegmentMissing, SegmentStore
from batchgen.core.work.shards import Segment

__all__ = ["SegmentFiles", "SegmentMissing"]

_READ_CHUNK = 1 << 20


class SegmentFiles(SegmentStore):
    """Segments under ``root``/segments."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.segments_dir = root / "segments"
        self.segments_dir.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"SegmentFiles({str(self.root)!r})"

    def write(self, key: str, data: bytes) -> int:
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

    def _read_whole(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _stored_size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def _listing(self, under: str = "") -> Iterator[tuple[str, float]]:
        for path in (self.segments_dir / under).rglob("*.jsonl"):
            with contextlib.suppress(FileNotFoundError):
                yield path.relative_to(self.root).as_posix(), path.stat().st_mtime

    def _delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.segments_dir.resolve()):
            raise ValueError(f"segment key {key!r} is outside the segments folder")
        return path
