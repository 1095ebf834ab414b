"""How the service calls its metadata store from the event loop (``MetadataCalls``).

A store on the local disk (SQLite) answers in microseconds, so its calls are made in place: an
``await calls(store.get_batch, batch_id)`` never suspends, and the service runs as it always did,
no slower. A store across a network says so with ``calls_block = True`` (``PostgresMetadataStore``):
a call can take milliseconds, and seconds while the database is cut off or restarting, so each
goes to a worker thread, at most ``limit`` at once (its connection pool's size), and the event
loop keeps serving polls, health checks and the requests in flight meanwhile.

``one_at_a_time()`` guards a check-then-write sequence that must not interleave with another
(creating a batch: its file is not in use by a running batch, then the row is written). In place
the sequence never yields, so there is nothing to guard and no lock is taken; in threads it holds
a lock across the sequence.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import ParamSpec, TypeVar

import anyio

from batchgen.core.storage.interfaces import MetadataStore

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Worker threads one store's calls may use at once.
DEFAULT_LIMIT = 4


def calls_block(store: MetadataStore) -> bool:
    """Whether the store's calls may wait on a network (and so must run off the event loop)."""
    return bool(getattr(store, "calls_block", False))


class MetadataCalls:
    """Calls to one metadata store: in place, or in worker threads for a store that blocks."""

    def __init__(self, store: MetadataStore, *, limit: int = DEFAULT_LIMIT) -> None:
        self.in_threads = calls_block(store)
        self._limiter = anyio.CapacityLimiter(limit) if self.in_threads else None
        self._sequence_lock = anyio.Lock() if self.in_threads else None

    async def __call__(self, function: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._limiter is None:
            return function(*args, **kwargs)
        return await anyio.to_thread.run_sync(
            functools.partial(function, *args, **kwargs), limiter=self._limiter
        )

    @contextlib.asynccontextmanager
    async def one_at_a_time(self) -> AsyncIterator[None]:
        if self._sequence_lock is None:
            yield
            return
        async with self._sequence_lock:
            yield
