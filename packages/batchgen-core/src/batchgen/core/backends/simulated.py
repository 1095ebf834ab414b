"""SimulatedBackend: a deterministic stand-in engine for tests and benchmarks (no model runs).

Given the same seed and request it returns the same text and token counts. Tokens are
whitespace-separated words; a chat prompt costs its words plus a few per message, as a chat
template would. Latency is ``latency_s`` per request plus ``token_latency_s`` per output token;
``capacity`` bounds how many requests it works on at once (the rest wait, as in a real engine);
``failure_rate`` injects transient failures from a seeded stream. Results are shaped exactly like
a real engine's, and prompts longer than the context are rejected as a real engine would.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import random
from collections.abc import Callable, Sequence

import anyio

from batchgen.core.backends.base import (
    BackendUnavailable,
    Outcome,
    ReportOutcome,
    RequestAborted,
    TransientBackendError,
    context_length_exceeded,
    generate_each,
)
from batchgen.core.backends.capabilities import GREEDY, SEEDED, Capabilities
from batchgen.core.backends.engine_activity import EngineActivity
from batchgen.core.backends.option_types import fraction, non_negative_float
from batchgen.core.backends.spec import BackendOption, BackendSpec
from batchgen.core.backends.text import flatten_content, trim_at_stop
from batchgen.core.models import GenerationRequest, GenerationResult, Health

_WORDS = [
    "the",
    "answer",
    "is",
    "four",
    "because",
    "two",
    "and",
    "two",
    "make",
    "four",
    "so",
    "we",
    "add",
    "them",
    "together",
    "and",
    "check",
    "each",
    "step",
    "carefully",
    "before",
    "giving",
    "a",
    "short",
    "clear",
    "reply",
    "to",
    "the",
    "question",
    "that",
    "was",
    "asked",
]

#: The words repeated, so that any run of up to 48 words can be sliced from any start.
_WORD_CYCLE = _WORDS * (1 + 48 // len(_WORDS) + 1)

#: Tokens a chat template adds around each message.
TOKENS_PER_MESSAGE = 3
#: Prompts longer than this (in characters) are counted in a worker thread, off the event loop.
LARGE_PROMPT_CHARS = 1 << 20


class SimulatedBackend:
    name = "simulated"
    #: Chat and completions (as a backend that declares nothing); the same text for the same
    #: request and seed, so greedy and seeded answers may be replayed by the result cache.
    capabilities = Capabilities(deterministic=frozenset({GREEDY, SEEDED}))

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        token_latency_s: float = 0.0,
        failure_rate: float = 0.0,
        capacity: int | None = None,
        context_length: int = 8192,
        seed: int = 0,
        model_name: str = "simulated",
    ) -> None:
        if not 0.0 <= failure_rate <= 1.0:
            raise ValueError("failure_rate must be between 0 and 1")
        self.latency_s = latency_s
        self.token_latency_s = token_latency_s
        self.failure_rate = failure_rate
        self.context_length = context_length
        self.seed = seed
        self.model_name = model_name
        self._capacity = anyio.Semaphore(capacity) if capacity else None
        self._failures = random.Random(seed)
        self._running: dict[str, Callable[[], object]] = {}
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        self._started = False
        for cancel in list(self._running.values()):
            cancel()

    def health(self) -> Health:
        if not self._started:
            return Health(False, "the simulated backend is not started")
        return Health(True)

    def engine_activity(self) -> EngineActivity:
        """The requests it is working on now (within ``capacity``, when set); its tokens come
        whole at each request's end, so it reports no count of them as they are made."""
        return EngineActivity(running=len(self._running))

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        if request.messages is not None:
            return sum(_word_count(_content(message)) + TOKENS_PER_MESSAGE for message in request.messages)
        return _word_count(request.prompt or "")

    def _count_and_complete(self, request: GenerationRequest) -> GenerationResult:
        result = self._complete_now(request, max_chars=-1)
        assert result is not None
        return result

    def _complete_now(
        self, request: GenerationRequest, max_chars: int = LARGE_PROMPT_CHARS
    ) -> GenerationResult | None:
        """The request's result, computed in one pass over its prompt; None when the prompt is longer
        than ``max_chars`` (then counting it is left to a worker thread; -1: no limit)."""
        messages = request.messages
        if messages is not None:
            contents = [_content(message) for message in messages]
            if max_chars >= 0 and sum(map(len, contents)) > max_chars:
                return None
            prompt_tokens = sum(map(_word_count, contents)) + TOKENS_PER_MESSAGE * len(contents)
            text = "\x1e".join(
                [
                    f"{message.get('role')}\x1f{content}"
                    for message, content in zip(messages, contents, strict=True)
                ]
            )
        else:
            text = request.prompt or ""
            if max_chars >= 0 and len(text) > max_chars:
                return None
            prompt_tokens = _word_count(text)
        if prompt_tokens > self.context_length:
            raise context_length_exceeded(prompt_tokens, self.context_length)
        return self._complete(request, text, prompt_tokens)

    def _complete(self, request: GenerationRequest, prompt_text: str, prompt_tokens: int) -> GenerationResult:
        sampling = request.sampling
        key = f"{self.seed}|{sampling.seed}|{sampling.temperature}|{prompt_text}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        natural_length = 4 + draw % 45  # 4..48 words
        limit = sampling.max_tokens
        length = min(natural_length, limit)
        start = (draw >> 16) % len(_WORDS)
        text = " ".join(_WORD_CYCLE[start : start + length])
        stopped = False
        if sampling.stop:
            text, stopped = trim_at_stop(text, sampling.stop)
            if stopped:
                length = len(text.split())
        finish_reason = "length" if natural_length > limit and not stopped else "stop"
        return GenerationResult(
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=length,
        )

    async def _result(self, request: GenerationRequest) -> GenerationResult:
        """The result of one attempt at ``request``, before its simulated latency; raises as
        ``generate`` does."""
        if not self._started:
            raise BackendUnavailable("the simulated backend is not started")
        result = self._complete_now(request)
        if result is None:  # counting words is slow: not on the loop
            result = await anyio.to_thread.run_sync(self._count_and_complete, request)
        if self.failure_rate and self._failures.random() < self.failure_rate:
            raise TransientBackendError("simulated transient failure")
        return result

    async def _wait(self, request_id: str, seconds: float) -> None:
        """Sleep ``seconds`` unless aborted first (then raise RequestAborted)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on asyncio (trio): the portable path below
            pass
        else:
            await self._wait_asyncio(loop, request_id, seconds)
            return
        with anyio.CancelScope() as scope:
            self._running[request_id] = scope.cancel
            try:
                await anyio.sleep(seconds)
            finally:
                del self._running[request_id]
        if scope.cancelled_caught:
            raise RequestAborted(request_id)

    async def _wait_asyncio(self, loop: asyncio.AbstractEventLoop, request_id: str, seconds: float) -> None:
        """The same on asyncio with one timer and one future: a tenth of the cost of a cancel scope,
        which matters when ten thousand simulated requests share the loop with the service."""
        waiter: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(seconds, _settle, waiter, True)
        self._running[request_id] = lambda: _settle(waiter, False)
        try:
            finished = await waiter
        finally:
            timer.cancel()
            del self._running[request_id]
        if not finished:
            raise RequestAborted(request_id)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self._result(request)
        delay = self.latency_s + self.token_latency_s * result.completion_tokens
        if delay > 0:
            if self._capacity is None:
                await self._wait(request.request_id, delay)
            else:
                async with self._capacity:
                    await self._wait(request.request_id, delay)
        return result

    async def generate_many(self, requests: Sequence[GenerationRequest], report: ReportOutcome) -> None:
        """The group at once: results are made in one loop; a request with latency waits on one
        timer, and is reported when it fires (or with ``RequestAborted`` when aborted first)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on asyncio (trio): one generate call each
            loop = None
        if loop is None or self._capacity is not None:
            await generate_each(self, requests, report)
            return
        timed: list[tuple[int, str, GenerationResult, float]] = []
        for position, request in enumerate(requests):
            try:
                result = await self._result(request)
            except Exception as exc:
                report(position, exc)
                continue
            delay = self.latency_s + self.token_latency_s * result.completion_tokens
            if delay > 0:
                timed.append((position, request.request_id, result, delay))
            else:
                report(position, result)
        if timed:
            await self._report_when_due(loop, timed, report)

    async def _report_when_due(
        self,
        loop: asyncio.AbstractEventLoop,
        timed: list[tuple[int, str, GenerationResult, float]],
        report: ReportOutcome,
    ) -> None:
        """Report each result when its delay has passed, unless it is aborted first. Requests of
        equal delay share one timer (delays come in steps of a token's latency), so thousands of
        requests in flight cost the event loop's timer heap a few entries per group."""
        pending: dict[str, int] = {}
        all_reported: asyncio.Future[None] = loop.create_future()
        due: dict[float, list[tuple[str, GenerationResult]]] = {}

        def end(request_id: str, outcome: Outcome) -> None:
            position = pending.pop(request_id, None)
            if position is None:
                return  # reported already (an abort after the result, or the other way round)
            self._running.pop(request_id, None)
            report(position, outcome)
            if not pending and not all_reported.done():
                all_reported.set_result(None)

        def end_due(results: list[tuple[str, GenerationResult]]) -> None:
            for request_id, result in results:
                end(request_id, result)

        for position, request_id, result, delay in timed:
            pending[request_id] = position
            due.setdefault(delay, []).append((request_id, result))
            self._running[request_id] = functools.partial(end, request_id, RequestAborted(request_id))
        timers = [loop.call_later(delay, end_due, results) for delay, results in due.items()]
        try:
            await all_reported
        finally:  # done, or cancelled (shutdown): what is not reported yet is abandoned
            for timer in timers:
                timer.cancel()
            for request_id in pending:
                self._running.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        cancel = self._running.get(request_id)
        if cancel is not None:
            cancel()


def _word_count(text: str, chunk: int = 1 << 18) -> int:
    """``len(text.split())``, in slices, so that a huge text never holds the GIL for long."""
    if len(text) <= chunk:
        return len(text.split())
    count = 0
    joined = False  # the previous slice ended inside a word
    for start in range(0, len(text), chunk):
        piece = text[start : start + chunk]
        words = len(piece.split())
        if joined and words and not piece[0].isspace():
            words -= 1  # that word began in the previous slice
        count += words
        joined = not piece[-1].isspace()
    return count


def _content(message: dict[str, object]) -> str:
    return flatten_content(message.get("content"), backend="simulated")


def _settle(waiter: asyncio.Future[bool], finished: bool) -> None:
    if not waiter.done():
        waiter.set_result(finished)


SPEC = BackendSpec(
    name="simulated",
    factory=SimulatedBackend,
    summary="runs no model: deterministic made-up text, for tests and benchmarks",
    options=(
        BackendOption(
            "latency_s",
            "--simulated-latency-s",
            non_negative_float,
            0.0,
            "seconds each simulated request takes, before per-token time",
        ),
        BackendOption(
            "token_latency_s",
            "--simulated-token-latency-s",
            non_negative_float,
            0.0,
            "extra seconds per simulated output token",
        ),
        BackendOption(
            "failure_rate",
            "--simulated-failure-rate",
            fraction,
            0.0,
            "share of simulated attempts that fail transiently (retried, then an error line)",
        ),
        BackendOption("seed", "--simulated-seed", int, 0, "seed of the simulated text"),
    ),
    context_length_keyword="context_length",
)
