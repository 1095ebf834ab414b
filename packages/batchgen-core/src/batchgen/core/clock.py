"""The service's clock: the whole seconds since the epoch that every API time is given in."""

from __future__ import annotations

import time


def now() -> int:
    """Whole seconds since the epoch, as the API reports times."""
    return int(time.time())
