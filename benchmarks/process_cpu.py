"""CPU seconds a process tree spends, by process name: where a benchmark's time goes, from ``/proc``.

``snapshot(pid)`` reads the user and system time of a process and of every descendant;
``spent(before, after)`` is what each name (the root under a label of its own) used between two
snapshots. A process that ended between them is left out (its time can no longer be read).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")

#: pid -> (name, CPU seconds so far)
Snapshot = dict[int, tuple[str, float]]


def _stat(pid: int) -> tuple[str, int, float] | None:
    """The name, parent pid and CPU seconds of one process (None if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is the state (the stat's third field): the parent is the 4th, utime and stime the 14th, 15th
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _name(pid: int, short: str) -> str:
    """A process's name: its short name, or for a Python process the start of its command line
    (``python -m ...``, ``python -c ...``: a worker or helper, not the interpreter)."""
    if not short.startswith("python"):
        return short
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return short
    return " ".join(["python", *words[1:3]]).split("\n")[0][:60]


def snapshot(root: int, root_name: str) -> Snapshot:
    """CPU seconds so far of ``root`` (named ``root_name``) and of each of its descendants."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (found := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = found
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (_, parent, _) in stats.items():
        children[parent].append(pid)
    taken: Snapshot = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        if pid in stats:
            name, _, seconds = stats[pid]
            taken[pid] = (root_name if pid == root else _name(pid, name), seconds)
            pending.extend(children[pid])
    return taken


def spent(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds used between two snapshots, summed by process name, largest first."""
    used: dict[str, float] = defaultdict(float)
    for pid, (name, seconds) in after.items():
        used[name] += seconds - before.get(pid, (name, 0.0))[1]
    return {name: round(seconds, 1) for name, seconds in sorted(used.items(), key=lambda item: -item[1])}
