"""Reading request lines back from an input file in blocks: neighbouring lines with one read.

The intake pool knows each queued line by its byte offset and length. Requests admitted together
are mostly neighbours in the file (a batch's lines are queued in file order, but for the lines of
one prompt prefix, gathered from across the file: ``scheduling.prefix_groups``), so ``read_spans``
reads the lines of a group with one ``pread`` per run of neighbours, at most ``block_bytes`` at a
time, instead of one ``pread`` per line. A line longer than a block is read alone; the bytes
between lines that are not asked for (lines already done, blank lines) are read and skipped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

#: The most bytes one read takes in, unless a single line is longer.
BLOCK_BYTES = 256 * 1024


class InputChanged(OSError):
    """The input file ends before a line its index records: it changed after it was indexed."""


def read_spans(fd: int, spans: Sequence[tuple[int, int]], block_bytes: int = BLOCK_BYTES) -> list[bytes]:
    """The bytes of each ``(offset, length)`` span of the open file ``fd``, in the order given.

    Spans that lie close together in the file are read with one ``pread`` covering them (no more
    than ``block_bytes``, or one span if it is longer). Raises ``InputChanged`` when the file is
    shorter than a span says.
    """
    lines: list[bytes] = [b""] * len(spans)
    order = sorted(range(len(spans)), key=lambda position: spans[position][0])
    start = 0
    while start < len(order):
        block_offset = spans[order[start]][0]
        block_end = block_offset + spans[order[start]][1]
        stop = start + 1
        while stop < len(order):
            offset, length = spans[order[stop]]
            if offset + length - block_offset > block_bytes:
                break
            block_end = max(block_end, offset + length)
            stop += 1
        block = os.pread(fd, block_end - block_offset, block_offset)
        if len(block) != block_end - block_offset:
            raise InputChanged(
                f"the input file ends at byte {block_offset + len(block)}, before its line at byte "
                f"{block_offset} of {block_end - block_offset} bytes"
            )
        if stop - start == 1:
            lines[order[start]] = block
        else:
            for position in order[start:stop]:
                offset, length = spans[position]
                relative = offset - block_offset
                lines[position] = block[relative : relative + length]
        start = stop
    return lines
