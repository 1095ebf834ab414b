"""The service's clock: the whole seconds since the epoch that every API time is given in.

API times are whole seconds, but a moment is not: a batch created 0.9 s into a second and
reported as created at that second has run 0.1 s, not a second, when the next one begins. So a
deadline is computed from the exact moment it counts from (``exact_now``) and rounded *up*
(``deadline``): reached when the whole-second clock (``now``) gets to it, it has never come
before its full span has passed, and comes less than a second after.
"""

from __future__ import annotations

import math
import time


def now() -> int:
    """Whole seconds since the epoch, as the API reports times."""
    return int(time.time())


def exact_now() -> float:
    """Seconds since the epoch, to the clock's resolution: what a deadline counts from."""
    return time.time()


def deadline(start: float, span_s: int) -> int:
    """The API time ``span_s`` whole seconds after the exact moment ``start``, rounded up: once
    ``now()`` has reached it, the full span has passed."""
    return math.ceil(start) + span_s  # exact: no float sum that could round the span short


def reached(deadline_s: int, moment: float) -> bool:
    """Whether the whole-second ``deadline_s`` has come at ``moment`` (seconds since the epoch)."""
    return moment >= deadline_s
