"""Either face of the client, called the same way, so that one test checks both.

`Blocking` wraps a `BatchGenHttpClient` or an `AsyncBatchGenClient`. Calling a method on it calls
the same method of the client; for the async face, a coroutine is run to its end on the test's
event loop and an async iterator is drained into a list. A test written as plain sync code thus
runs against both faces. `Sleeps` records the waits of either face instead of sleeping.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal, Self

import httpx

from batchgen.client import AsyncBatchGenClient, BatchGenHttpClient, RetryPolicy

Face = Literal["sync", "async"]
FACES: tuple[Face, ...] = ("sync", "async")
BASE = "http://batchgen.test"


class Sleeps(list[float]):
    """Records the client's waits (retries and polls), from either face, instead of sleeping."""

    def sleep(self, seconds: float) -> None:
        self.append(seconds)

    async def async_sleep(self, seconds: float) -> None:
        self.append(seconds)

    def policy(self, **kwargs: Any) -> RetryPolicy:
        return RetryPolicy(sleep=self.sleep, async_sleep=self.async_sleep, **kwargs)


class Blocking:
    """A client of either face whose methods are called as if it were the sync one."""

    def __init__(self, client: BatchGenHttpClient | AsyncBatchGenClient, runner: asyncio.Runner) -> None:
        self.client = client
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._finish(attribute(*args, **kwargs))

        return call

    def _finish(self, result: Any) -> Any:
        if inspect.iscoroutine(result):
            return self._runner.run(result)
        if isinstance(result, AsyncIterator):
            return self._runner.run(_drain(result))
        return result

    def close(self) -> None:
        if isinstance(self.client, AsyncBatchGenClient):
            self._runner.run(self.client.aclose())
        else:
            self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


async def _drain(lines: AsyncIterator[Any]) -> list[Any]:
    return [line async for line in lines]


Handler = Callable[[httpx.Request], httpx.Response]
MakeClient = Callable[..., Blocking]


@contextmanager
def client_maker(face: Face, sleeps: Sleeps) -> Iterator[MakeClient]:
    """`make(handler, base_url=BASE, **kwargs)`: a client of `face` on a MockTransport serving
    `handler`, with `sleeps.policy()` unless `retry=` is given (`base_url=None`: the default).
    Every client made is closed at the end, and the async face's event loop with them."""
    made: list[Blocking] = []
    with asyncio.Runner() as runner:

        def make(handler: Handler, base_url: str | None = BASE, **kwargs: Any) -> Blocking:
            kwargs.setdefault("retry", sleeps.policy())
            args = () if base_url is None else (base_url,)
            transport = httpx.MockTransport(handler)
            client: BatchGenHttpClient | AsyncBatchGenClient
            if face == "sync":
                client = BatchGenHttpClient(*args, transport=transport, **kwargs)
            else:
                client = AsyncBatchGenClient(*args, transport=transport, **kwargs)
            made.append(Blocking(client, runner))
            return made[-1]

        try:
            yield make
        finally:
            for client in made:
                if not client.is_closed:
                    client.close()
