"""The API side yields the CPU to the model: ``lower_api_priority`` raises the server's nice value.

When cores are scarce (two, say), the HTTP side (the event loop answering polls, JSON, logging)
competes with the model for them. The model's work comes first: once the service has started
(and with it any model worker process), the server raises its own nice value by ``--api-nice``
(10 by default), so that the scheduler gives the model the cores whenever both want them, and the
API still answers at once when the model does not need them all.

On Linux the nice value belongs to each thread, and a new thread or process inherits its
creator's: the raise applies to the thread running the app (the event loop) and to everything it
starts from then on, not to threads started before it, such as the transformers backend's
supervisor thread, which starts its worker processes (so a restarted worker keeps the priority
the first one had). Nothing can lower the value again without privileges, so it is raised once.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("batchgen.server")


def lower_api_priority(increment: int) -> int | None:
    """Raise the calling thread's nice value by ``increment`` (0: leave it); the new value, or None."""
    if increment <= 0:
        return None
    try:
        value = os.nice(increment)
    except OSError as exc:  # a platform or sandbox without it: serve anyway, at the same priority
        logger.warning("could not lower the API's priority (nice +%d): %s", increment, exc)
        return None
    logger.info("the API runs at nice %d so that the model's work comes first on a busy CPU", value)
    return value
