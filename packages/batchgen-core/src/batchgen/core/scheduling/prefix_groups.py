"""The order a batch's queued lines are admitted in: lines of one prompt prefix together.

``grouped_by_prefix`` reorders a batch's pending line positions so that lines with equal prefix
keys (``prefix_keys``) are neighbours: the groups in the order of their first line, and each
group's lines in their own order. So an engine's prefix cache computes a shared prefix once for
its whole group, instead of once per line when the lines of many prefixes are shuffled. A batch
with no repeated key keeps its order exactly (each group is one line), so a workload with no
shared prefix admits in file order, as before, and reads its lines back in file order.

Only the first ``MAX_PREFIX_GROUPS`` distinct keys of a batch are remembered (bounded memory for
a batch of a million distinct prompts): a line whose key is new after that keeps its place. It
runs once, when the batch is queued: O(lines) time; a batch with no repeated key costs one pass
and a set of its keys, one with repeats an array of 8 bytes and a byte per line besides the
result while it runs. Nothing about which batch or tenant an admission goes to
changes: only which of a batch's own lines comes next.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

__all__ = ["MAX_PREFIX_GROUPS", "grouped_by_prefix"]

#: The most distinct prefix keys of one batch that are grouped.
MAX_PREFIX_GROUPS = 1 << 16


def grouped_by_prefix(pending: array, keys: Sequence[int], max_groups: int = MAX_PREFIX_GROUPS) -> array:
    """``pending`` (positions into ``keys``) with the positions of each key made contiguous: the
    groups in order of first appearance, each group in its order in ``pending``. ``pending``
    itself when no key repeats (found first, with nothing allocated but a set of the keys)."""
    if not _repeats(pending, keys, max_groups):
        return pending
    count = len(pending)
    following = array("l", [-1]) * count  # following[i]: where in ``pending`` i's group goes on
    last: dict[int, int] = {}  # key -> where in ``pending`` its group's last line is so far
    starts = bytearray(count)  # 1 where a group starts
    for i, position in enumerate(pending):
        key = keys[position]
        previous = last.get(key)
        if previous is None:
            starts[i] = 1
            if len(last) < max_groups:
                last[key] = i
        else:
            following[previous] = i
            last[key] = i
    del last
    ordered = array("l")
    append = ordered.append
    start = starts.find(1)
    while start != -1:
        i = start
        while i != -1:
            append(pending[i])
            i = following[i]
        start = starts.find(1, start + 1)
    return ordered


def _repeats(pending: array, keys: Sequence[int], max_groups: int) -> bool:
    """Whether a key among the first ``max_groups`` distinct ones of ``pending`` comes again."""
    seen: set[int] = set()
    for position in pending:
        key = keys[position]
        if key in seen:
            return True
        if len(seen) < max_groups:
            seen.add(key)
    return False
