"""Shards: fixed ranges of a batch's input lines, the unit replicas lease, run and commit.

A batch's lines are cut once, when the batch starts, into shards of ``SHARD_LINES`` lines (the
last one shorter). A replica leases a shard for a while, runs its lines, and commits their output
in segments; every commit carries the lease's **epoch**, which the ledger raised when it handed
the shard out, so a replica whose lease was taken over (it was paused, or cut off from the
database) cannot commit any more: its epoch is no longer the shard's.

Small shards balance the work and bound what a dead replica's successor redoes (at most the
uncommitted part of the shards it held); large ones mean fewer ledger rows. 512 lines make a
million-line batch about two thousand rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = [
    "DEFAULT_LEASE_S",
    "ERRORS",
    "MAX_LEASE_S",
    "OUTPUT",
    "SEGMENT_KINDS",
    "SHARD_LINES",
    "Lease",
    "Segment",
    "SegmentKind",
    "SegmentPart",
    "ShardRange",
    "check_lines",
    "plan_shards",
]

#: Lines per shard (the last shard of a batch holds the rest).
SHARD_LINES = 512

#: How long a lease lasts unless renewed, by default: what a dead replica's shards wait before
#: another replica takes them (renewed every third of it).
DEFAULT_LEASE_S = 10.0
#: The longest lease the ledger hands out (a day): a longer one would keep a dead replica's
#: shards from everyone else for longer than any batch's window.
MAX_LEASE_S = 86_400.0

#: What a segment holds: result lines, or error lines (the output and error files).
SegmentKind = str
OUTPUT, ERRORS = "output", "errors"
SEGMENT_KINDS = (OUTPUT, ERRORS)


@attrs.frozen
class ShardRange:
    """Lines ``first_line`` .. ``first_line + n_lines - 1`` of a batch's input (0-based)."""

    shard_no: int
    first_line: int
    n_lines: int

    @property
    def lines(self) -> range:
        return range(self.first_line, self.first_line + self.n_lines)


def plan_shards(line_count: int, shard_lines: int = SHARD_LINES) -> list[ShardRange]:
    """The shards of a batch of ``line_count`` lines: consecutive, covering every line once."""
    if line_count < 0:
        raise ValueError(f"a batch cannot have {line_count} lines")
    if shard_lines < 1:
        raise ValueError(f"a shard needs at least one line, not {shard_lines}")
    return [
        ShardRange(number, first, min(shard_lines, line_count - first))
        for number, first in enumerate(range(0, line_count, shard_lines))
    ]


@attrs.frozen
class Lease:
    """A shard handed to one replica until the ledger's clock passes its expiry.

    ``done_lines`` are the shard's lines already committed (by earlier owners): the new owner runs
    only the others. ``epoch`` fences every commit made under this lease.
    """

    batch_id: str
    shard: ShardRange
    owner_id: str
    epoch: int
    done_lines: frozenset[int] = frozenset()

    @property
    def key(self) -> tuple[str, int]:
        return (self.batch_id, self.shard.shard_no)

    @property
    def remaining(self) -> list[int]:
        """The shard's lines nobody has committed yet, in order."""
        return [line for line in self.shard.lines if line not in self.done_lines]


@attrs.frozen
class SegmentPart:
    """What one commit adds: ``size`` bytes of ``object_key`` in the segment store, holding the
    result (``OUTPUT``) or error (``ERRORS``) lines of the listed input ``lines``.

    ``failed_lines`` of them record a failure (``requests.line_outcomes``), the rest a completion:
    the commit counts them so. An error segment holds failures only; an output segment may hold
    both (the user guide's convention keeps error lines with the results)."""

    kind: SegmentKind
    object_key: str
    size: int
    lines: tuple[int, ...]
    #: The tokens of its lines' answers, added to the batch's usage by the commit.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_cached_tokens: int = 0
    failed_lines: int = attrs.field(kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"a segment holds one of {SEGMENT_KINDS}, not {self.kind!r}")
        if self.size < 0:
            raise ValueError(f"a segment cannot be {self.size} bytes")
        if not 0 <= self.failed_lines <= len(self.lines):
            raise ValueError(f"{self.failed_lines} of a segment's {len(self.lines)} lines cannot fail")
        if self.kind == ERRORS and self.failed_lines != len(self.lines):
            raise ValueError("an error segment holds failed lines only")

    @property
    def completed_lines(self) -> int:
        """How many of its lines record a completion."""
        return len(self.lines) - self.failed_lines


@attrs.frozen
class Segment:
    """One committed segment of a batch's output or errors, as the manifest lists it.

    ``object_key`` names the bytes in the segment store; only the first ``size`` bytes of it
    count (a POSIX segment may hold a torn tail past what was committed)."""

    batch_id: str
    kind: SegmentKind
    shard_no: int
    seq: int
    epoch: int
    object_key: str
    size: int
    lines: tuple[int, ...]


def check_lines(shard: ShardRange, lines: Sequence[int]) -> None:
    """ValueError unless ``lines`` are distinct lines of ``shard``."""
    if len(set(lines)) != len(lines):
        raise ValueError("a segment lists a line twice")
    outside = [line for line in lines if line not in shard.lines]
    if outside:
        raise ValueError(f"lines {outside[:5]} are not in shard {shard.shard_no}")
