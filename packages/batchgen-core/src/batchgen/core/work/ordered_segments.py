"""A shared batch's committed segments of one kind read in input-line order, a byte range at a time.

The committed bytes stay as they were written; the order is made as they are read, from the
manifest alone, so every replica serves the same bytes:

- Shards are consecutive ranges of input lines (``shards``), so the lines in input order are the
  shards in ``shard_no`` order, and within a shard its committed lines sorted by line number.
- Each segment's manifest entry lists the input lines it holds, in the order written, and its
  committed size. A shard's size in input order is the sum of its segments' (the same lines), so
  the whole is as long as the segments laid end to end in commit order, and a byte range maps to
  the shards it touches by their sizes' prefix sums: only those shards are read.
- A shard holds at most ``SHARD_LINES`` lines: its segments are read whole, split into lines
  (each ends with a newline), paired with the manifest's line numbers and sorted. Memory holds
  one shard's segments at a time.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

import attrs

from batchgen.core.work.segment_store import SegmentStore
from batchgen.core.work.shards import Segment

__all__ = ["InputOrder", "SegmentLinesMismatch"]

#: The most bytes one piece handed on holds.
_PIECE_BYTES = 1 << 20


class SegmentLinesMismatch(ValueError):
    """A committed segment's bytes do not split into the lines its manifest entry lists."""


@attrs.frozen
class _ShardSegments:
    """The committed segments of one shard, in commit order, and where the shard's bytes start."""

    start: int
    size: int
    segments: tuple[Segment, ...]


@attrs.frozen
class InputOrder:
    """Committed segments of one kind laid out in input-line order (see the module)."""

    shards: tuple[_ShardSegments, ...]
    size: int
    #: Where each shard's bytes start (its ``start``), for finding the first shard of a range.
    starts: tuple[int, ...] = attrs.field(init=False)

    @starts.default
    def _starts(self) -> tuple[int, ...]:
        return tuple(shard.start for shard in self.shards)

    @classmethod
    def of(cls, segments: Sequence[Segment]) -> InputOrder:
        """The layout of ``segments`` (of one kind, in commit order) in input order."""
        by_shard = sorted(segments, key=lambda segment: segment.shard_no)  # stable: commit order kept
        shards, start = [], 0
        for _, grouped in itertools.groupby(by_shard, key=lambda segment: segment.shard_no):
            held = tuple(grouped)
            size = sum(segment.size for segment in held)
            shards.append(_ShardSegments(start, size, held))
            start += size
        return cls(tuple(shards), start)

    def read(self, store: SegmentStore, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes ``start`` .. ``end`` (exclusive; None: to the end) in input order, in pieces,
        reading only the shards the range touches. Nothing is read until the first piece is asked
        for."""
        end = self.size if end is None else min(end, self.size)
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        for shard in self.shards[first:]:
            if shard.start >= end:
                return
            low, high = max(start, shard.start), min(end, shard.start + shard.size)
            if low >= high:
                continue
            ordered = memoryview(_in_input_order(store, shard.segments))
            for offset in range(low - shard.start, high - shard.start, _PIECE_BYTES):
                yield bytes(ordered[offset : min(offset + _PIECE_BYTES, high - shard.start)])


def _in_input_order(store: SegmentStore, segments: Sequence[Segment]) -> bytes:
    """One shard's committed lines, read from its ``segments`` and sorted by input line number."""
    numbered: list[tuple[int, bytes]] = []
    for segment in segments:
        numbered.extend(zip(segment.lines, _lines_of(segment, b"".join(store.read([segment]))), strict=True))
    numbered.sort(key=lambda pair: pair[0])
    return b"".join(line for _, line in numbered)


def _lines_of(segment: Segment, data: bytes) -> list[bytes]:
    """The lines of a segment's committed bytes, each with its newline; SegmentLinesMismatch
    unless they are as many as the manifest lists."""
    pieces = data.split(b"\n")
    if pieces[-1] or len(pieces) - 1 != len(segment.lines):
        raise SegmentLinesMismatch(
            f"segment {segment.object_key} holds {len(pieces) - 1} whole lines and "
            f"{'a partial one' if pieces[-1] else 'no partial one'}; its manifest lists "
            f"{len(segment.lines)}"
        )
    return [piece + b"\n" for piece in pieces[:-1]]
