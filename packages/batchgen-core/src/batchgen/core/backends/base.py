"""The Backend protocol every inference engine implements, and the errors ``generate`` may raise.

A backend may also take requests in groups (``GroupingBackend.generate_many``); ``generate_all``
hands a group to any backend, through its ``generate_many`` or, by default, one concurrent
``generate`` call per request.

RequestRejected        this request can never succeed (e.g. context_length_exceeded): write
                       an error line, do not retry
TransientBackendError  this attempt failed; a retry may succeed
RequestAborted         the request was aborted through ``abort``
BackendUnavailable     the engine is gone; the service reports itself unhealthy
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import anyio

from batchgen.core.errors import CannotStart
from batchgen.core.models import GenerationRequest, GenerationResult, Health


class RequestRejected(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TransientBackendError(Exception):
    pass


class RequestAborted(Exception):
    pass


class BackendUnavailable(CannotStart):
    """The engine cannot start, or is gone (the service reports itself unhealthy)."""


def context_length_exceeded(prompt_tokens: int, context_length: int) -> RequestRejected:
    """The rejection every backend raises for a prompt longer than its context."""
    return RequestRejected(
        "context_length_exceeded",
        f"Prompt length {prompt_tokens} exceeds model context {context_length}",
    )


@runtime_checkable
class Backend(Protocol):
    """One inference engine. Backends own chat templating, tokenization and their own batching.

    The service calls every method from its event loop's thread. ``generate`` is called
    concurrently, up to ``--max-pool-size`` calls at once: the backend queues, batches or spreads
    them as its engine needs, and never blocks the event loop (run blocking work in a thread).
    ``abort`` and ``health`` may be called while ``generate`` calls are running.

    A backend may also implement ``generate_many`` (``GroupingBackend``) to take several requests
    in one call; the service calls ``generate_all``, which falls back to ``generate``.

    ``tests/core/test_backend_contract.py`` checks what this contract promises for every backend.
    """

    #: The name the backend is registered under (``--backend NAME``).
    name: str
    #: The model that output lines and ``GET /v1/models`` report; ``start`` may fill it in.
    model_name: str

    async def start(self) -> None:
        """Make the backend ready to generate: load the model, start the engine, open connections.

        Called once before the first ``generate``; it may take minutes, and the server answers no
        request until it returns. Calling it on a started backend does nothing. Raise
        ``BackendUnavailable`` with the reason when the engine cannot start at all. A backend
        whose engine may come later (upstream servers not answering yet) may start anyway and
        say so through ``health`` until then.
        """
        ...

    async def stop(self) -> None:
        """Release the engine and everything ``start`` opened.

        ``generate`` calls still running end soon, raising ``RequestAborted`` or
        ``BackendUnavailable`` (the service has abandoned them by then). Afterwards ``health`` is
        not healthy and ``generate`` raises ``BackendUnavailable``. Stopping a stopped or
        never-started backend does nothing. The service does not start a stopped backend again.
        """
        ...

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run one request to its end and return its result.

        The result has the answer's text (never containing one of ``request.sampling.stop``),
        ``finish_reason`` ``"stop"`` (a natural end or a stop string) or ``"length"`` (the output
        limit ``sampling.max_tokens``, or the context, was reached), and the prompt and completion
        token counts as the engine counts them; ``completion_tokens`` never exceeds ``max_tokens``.
        ``cached_tokens`` is None (the engine does not say) or the prompt tokens its prefix cache
        served, within 0..``prompt_tokens`` (``backends.cached_tokens``). A ``<think>`` block goes
        to ``reasoning_content`` (see ``backends.text``).

        Raise, by what the failure means:

        - ``RequestRejected(code, message)``: this request can never succeed (its prompt is longer
          than the context: ``context_length_exceeded``; it is malformed for this engine:
          ``invalid_request``). The service writes an error line with that code; no retry.
        - ``TransientBackendError``: this attempt failed but another may succeed (the engine was
          busy, ran out of memory). The service retries, then writes a ``backend_error`` line.
        - ``RequestAborted``: ``abort(request.request_id)`` was called while it ran. Only then; a
          request that finished before the abort took effect may return its result instead.
        - ``BackendUnavailable``: the backend is not started, is stopped, or its engine is gone.
          The service fails the running batches and reports itself unhealthy.

        Any other exception is a bug in the backend.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """End the running ``generate`` call for ``request_id`` soon; that call raises ``RequestAborted``.

        Best effort and harmless: an unknown id, a finished request or a second abort does
        nothing and raises nothing. It may return before the aborted call has ended.
        """
        ...

    def health(self) -> Health:
        """Whether requests can run now, and if not, why: ``Health(False, reason)``.

        Called on every ``GET /health``: cheap and non-blocking, no I/O, no waiting; report state
        the backend already keeps. Not healthy before ``start``, after ``stop``, or once the
        engine is gone.
        """
        ...


#: What ``generate_many`` reports for one request: its result, or the exception ``generate`` would
#: have raised for it.
Outcome = GenerationResult | Exception
#: ``report(position, outcome)``: request ``requests[position]`` has ended with ``outcome``.
ReportOutcome = Callable[[int, Outcome], None]


@runtime_checkable
class GroupingBackend(Backend, Protocol):
    """A backend that takes a group of requests in one call, which costs less than a call each."""

    async def generate_many(self, requests: Sequence[GenerationRequest], report: ReportOutcome) -> None:
        """Run every request of ``requests`` to its end, reporting each the moment it ends.

        Calls ``report(position, outcome)`` exactly once for each position, from the event loop's
        thread, as soon as that request has ended: with its ``GenerationResult``, or with the
        exception ``generate`` would have raised for it alone (``RequestRejected``,
        ``TransientBackendError``, ``RequestAborted`` after ``abort(request_id)``,
        ``BackendUnavailable``; anything else is a bug). One request's failure never ends the
        others. Returns once every request has been reported. ``abort`` works on each request by
        its ``request_id`` as it does for ``generate``. ``report`` does not raise. When the call
        itself is cancelled (the service is shutting down), requests not reported yet are
        abandoned: nothing more is reported for them.
        """
        ...


async def generate_each(
    backend: Backend, requests: Sequence[GenerationRequest], report: ReportOutcome
) -> None:
    """The default ``generate_many``: one ``generate`` call per request, all running at once."""

    async def run(position: int, request: GenerationRequest) -> None:
        try:
            outcome: Outcome = await backend.generate(request)
        except Exception as exc:
            outcome = exc
        report(position, outcome)

    if len(requests) == 1:
        await run(0, requests[0])
        return
    async with anyio.create_task_group() as tasks:
        for position, request in enumerate(requests):
            tasks.start_soon(run, position, request)


async def generate_all(
    backend: Backend, requests: Sequence[GenerationRequest], report: ReportOutcome
) -> None:
    """Run ``requests`` on ``backend`` as ``GroupingBackend.generate_many`` promises: through the
    backend's own ``generate_many`` when it has one, else through ``generate_each``."""
    generate_many = getattr(backend, "generate_many", None)
    if generate_many is not None:
        await generate_many(requests, report)
    else:
        await generate_each(backend, requests, report)
