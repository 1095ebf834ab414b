"""Where one upload's parts lie on disk, and how they become one file (``chunked_uploads`` uses it).

In the upload's folder::

    arrived.log        the parts received one at a time, each written where the one before ended
    arrived.index      one JSON line per part in ``arrived.log``: its id, offset and size
    {part_id}.part     a part received while another was arriving (a file of its own, written as
                       ``{part_id}.receiving`` and renamed once whole)
    assembled.jsonl    the file being assembled

A part is received straight into the log when no other part of the upload is arriving into it
(the SDK sends parts one after another, so they all are); its index line is written once it is
accepted, and a part refused or cut short is cut off the log again. Each byte is written once:
when the parts are completed in the order they arrived, the log is renamed to be the file, and
nothing is copied. Any other order is assembled by copying the parts, in the order named, into
``assembled.jsonl``: a part in a file of its own is deleted once appended, the log once the file
is whole (so for that order the log's bytes are held twice for a moment).

After a crash, ``repair`` cuts the log back to the parts its index names whole (what arrived after
them was a part in flight), and assembly resumes: a part's own file is deleted only once appended,
and the file is cut back to the end of the last part wholly in it before the next is copied.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import attrs

from batchgen.core.errors import BatchGenError
from batchgen.core.files.streamed_validation import Segment
from batchgen.core.files.write_behind import open_write_behind

LOG = "arrived.log"
INDEX = "arrived.index"
ASSEMBLED = "assembled.jsonl"
RECORD = "upload.json"
_COPY_BYTES = 1 << 24
#: copy_file_range errors that mean "copy the bytes by hand instead".
_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})


@attrs.frozen
class PartDestination:
    """Where a part's bytes are received: the log from ``offset`` on, or (``offset`` None) a file
    of its own at ``path``."""

    part_id: str
    path: Path
    offset: int | None = None

    @property
    def in_log(self) -> bool:
        return self.offset is not None

    def open(self) -> BinaryIO:
        """The stream to write the part's bytes to (closed by the caller before ``commit``); its
        writeback to disk starts as it is written (``write_behind``)."""
        return open_write_behind(self.path, position=self.offset)

    def received_bytes(self) -> int:
        size = self.path.stat().st_size
        return size if self.offset is None else size - self.offset


def _copy_range(source: str, offset: int, length: int, destination: BinaryIO) -> None:
    """Append ``length`` bytes of ``source`` from ``offset`` to ``destination`` (at its position)."""
    with open(source, "rb") as stream:
        try:
            while length > 0:
                copied = os.copy_file_range(
                    stream.fileno(), destination.fileno(), min(_COPY_BYTES, length), offset
                )
                if not copied:
                    raise BatchGenError(f"{source}: {length} bytes of a part are missing")
                offset += copied
                length -= copied
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
            stream.seek(offset)
            while length > 0:
                chunk = stream.read(min(_COPY_BYTES, length))
                if not chunk:
                    raise BatchGenError(f"{source}: {length} bytes of a part are missing") from exc
                destination.write(chunk)
                length -= len(chunk)


def _index_line(part_id: str, offset: int, length: int) -> bytes:
    """The index line of a part in the log."""
    return json.dumps({"id": part_id, "offset": offset, "bytes": length}).encode() + b"\n"


class PartFolder:
    """One upload's parts in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log = folder / LOG
        self.index = folder / INDEX

    def log_parts(self) -> dict[str, Segment]:
        """The parts in the log, in the order they arrived (an index line cut by a crash ends it)."""
        found: dict[str, Segment] = {}
        with contextlib.suppress(FileNotFoundError), open(self.index, "rb") as stream:
            for line in stream:
                try:
                    entry = json.loads(line)
                    found[entry["id"]] = Segment(str(self.log), int(entry["offset"]), int(entry["bytes"]))
                except (ValueError, KeyError, TypeError):
                    break
        return found

    def parts(self) -> dict[str, Segment]:
        """Every part received whole: those in the log, then those in files of their own."""
        found = self.log_parts()
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.folder):
                if entry.name.endswith(".part"):
                    found[entry.name.removesuffix(".part")] = Segment(entry.path, 0, entry.stat().st_size)
        return found

    def _log_end(self) -> int:
        return max((offset + length for _, offset, length in self.log_parts().values()), default=0)

    def destination(self, part_id: str, *, into_log: bool, log_end: int | None = None) -> PartDestination:
        """Where to receive a new part: the end of the log (only one part at a time may be
        received there), or a file of its own. ``log_end``: where the log's parts end, when the
        caller keeps count (else the index is read)."""
        if into_log:
            return PartDestination(part_id, self.log, self._log_end() if log_end is None else log_end)
        return PartDestination(part_id, self.folder / f"{part_id}.receiving")

    def commit(self, destination: PartDestination, size: int) -> Segment:
        """Keep a part received whole (``size`` bytes); where it now lies."""
        if destination.offset is None:
            path = self.folder / f"{destination.part_id}.part"
            os.replace(destination.path, path)
            return Segment(str(path), 0, size)
        with open(self.index, "ab") as stream:
            stream.write(_index_line(destination.part_id, destination.offset, size))
            stream.flush()
            os.fsync(stream.fileno())
        return Segment(str(self.log), destination.offset, size)

    @staticmethod
    def discard(destination: PartDestination) -> None:
        """Forget a part not committed: its file is deleted, or the log cut back to where it began."""
        with contextlib.suppress(FileNotFoundError):
            if destination.offset is None:
                destination.path.unlink()
            else:
                os.truncate(destination.path, destination.offset)

    def repair(self) -> None:
        """After a crash: delete parts half received, and cut the log (and its index) back to the
        parts it holds whole."""
        for leftover in self.folder.glob("*.receiving"):
            leftover.unlink(missing_ok=True)
        try:
            size = self.log.stat().st_size
        except FileNotFoundError:
            size = 0
        kept: list[tuple[str, Segment]] = []
        end = 0
        for part_id, segment in self.log_parts().items():
            if segment.offset != end or segment.offset + segment.length > size:
                break
            kept.append((part_id, segment))
            end += segment.length
        lines = b"".join(_index_line(part_id, offset, length) for part_id, (_, offset, length) in kept)
        if self.index.exists() and self.index.read_bytes() != lines:
            temporary = self.index.with_suffix(".tmp")
            temporary.write_bytes(lines)
            os.replace(temporary, self.index)
        if size > end:
            os.truncate(self.log, end)

    def drop(self) -> None:
        """Delete every part (the record stays)."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.folder):
                if entry.name != RECORD:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def pieces(self, order: Sequence[str], sizes: Sequence[int]) -> list[Segment]:
        """The parts ``order`` names, where they lie (a part's own file may be gone: appended)."""
        in_log = self.log_parts()
        return [
            in_log.get(part_id) or Segment(str(self.folder / f"{part_id}.part"), 0, size)
            for part_id, size in zip(order, sizes, strict=True)
        ]

    def whole_log(self, order: Sequence[str]) -> bool:
        """Whether ``order`` is the log's parts in the order they arrived, from its start."""
        in_log = self.log_parts()
        position = 0
        for part_id in order:
            segment = in_log.get(part_id)
            if segment is None or segment.offset != position:
                return False
            position += segment.length
        return True

    def assemble(self, order: Sequence[str], sizes: Sequence[int], skip: int, *, log_busy: bool) -> Path:
        """Make the parts one file, ``assembled.jsonl``, in the order named, its first ``skip``
        bytes left out (a byte order mark); resumes one a crash cut short. ``log_busy``: a part
        is arriving into the log, so it cannot be renamed."""
        target = self.folder / ASSEMBLED
        total = sum(sizes) - skip
        if not skip and not log_busy and self.whole_log(order):
            if self.log.exists():
                os.replace(self.log, target)  # the bytes as they arrived: nothing copied
            size = target.stat().st_size
            if size < total:
                raise BatchGenError(f"{self.folder.name}: the parts hold {size} bytes, expected {total}")
            os.truncate(target, total)  # a part sent again after the last one named
            return target
        in_log = self.log_parts()
        end = 0
        skip_left = skip  # the mark may be cut across tiny parts
        for index, (part_id, segment) in enumerate(zip(order, self.pieces(order, sizes), strict=True)):
            trim = min(skip_left, segment.length)
            skip_left -= trim
            start, end = end, end + segment.length - trim
            own_file = part_id not in in_log
            if own_file and not os.path.exists(segment.path):
                continue  # appended before a crash, and deleted
            if not own_file and target.exists() and target.stat().st_size >= end:
                continue  # copied before a crash
            if index == 0 and own_file and not skip:
                os.replace(segment.path, target)
                continue
            with open(target, "r+b" if target.exists() else "wb") as stream:
                stream.truncate(start)  # a part copied only in part before a crash
                stream.seek(start)
                _copy_range(segment.path, segment.offset + trim, segment.length - trim, stream)
            if own_file:
                os.unlink(segment.path)
        size = target.stat().st_size
        if size != total:
            raise BatchGenError(f"{self.folder.name}: assembled {size} bytes, expected {total}")
        self.log.unlink(missing_ok=True)
        return target
