"""EchoBackend: a complete BatchGen backend that answers each request with its own words.

It runs no model. A chat request is answered with the text of its last message, a completion
request with its prompt, after ``prefix`` if one is set. A token is a whitespace-separated word,
and each output word takes ``token_delay_s``, so a running request can be aborted. It keeps the
``Backend`` contract of ``batchgen.core.backends.base`` and is tested by BatchGen's shared
backend contract suite; docs/backends-writing.md walks through it.
"""

from __future__ import annotations

import anyio

from batchgen.core.backends import (
    BackendOption,
    BackendSpec,
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
)
from batchgen.core.backends.base import context_length_exceeded
from batchgen.core.backends.option_types import non_negative_float
from batchgen.core.backends.text import flatten_content, trim_at_stop
from batchgen.core.models import GenerationRequest, GenerationResult, Health


class EchoBackend:
    name = "echo"

    def __init__(
        self, *, prefix: str | None = None, token_delay_s: float = 0.0, context_length: int = 4096
    ) -> None:
        self.prefix = prefix
        self.token_delay_s = token_delay_s
        self.context_length = context_length
        self.model_name = "echo"
        self._started = False
        self._running: dict[str, anyio.CancelScope] = {}

    async def start(self) -> None:
        self._started = True  # nothing to load; a real backend loads its model here

    async def stop(self) -> None:
        self._started = False
        for scope in list(self._running.values()):
            scope.cancel()  # the requests still running raise RequestAborted

    def health(self) -> Health:
        return Health(True) if self._started else Health(False, "the echo backend is not started")

    async def abort(self, request_id: str) -> None:
        scope = self._running.get(request_id)
        if scope is not None:  # an unknown or finished request: nothing to do
            scope.cancel()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not self._started:
            raise BackendUnavailable("the echo backend is not started")
        prompt, answer = self._read(request)
        prompt_tokens = len(prompt.split())
        if prompt_tokens > self.context_length:
            raise context_length_exceeded(prompt_tokens, self.context_length)
        words = (self.prefix or "").split() + answer.split()
        limit = request.sampling.max_tokens
        text, stopped = trim_at_stop(" ".join(words[:limit]), request.sampling.stop)
        completion_tokens = len(text.split())
        with anyio.CancelScope() as scope:
            self._running[request.request_id] = scope
            try:
                await anyio.sleep(self.token_delay_s * completion_tokens)
            finally:
                del self._running[request.request_id]
        if scope.cancelled_caught:
            raise RequestAborted(request.request_id)
        return GenerationResult(
            text=text,
            finish_reason="length" if len(words) > limit and not stopped else "stop",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )

    def _read(self, request: GenerationRequest) -> tuple[str, str]:
        """The whole prompt's text (what counts against the context) and the text to echo."""
        if request.messages is not None:
            texts = [flatten_content(message.get("content"), backend="echo") for message in request.messages]
            return " ".join(texts), texts[-1] if texts else ""
        if not isinstance(request.prompt, str):
            raise RequestRejected("invalid_request", "The echo backend takes a string prompt.")
        return request.prompt, request.prompt


SPEC = BackendSpec(
    name="echo",
    factory=EchoBackend,
    summary="answers each request with its own words (an example backend package)",
    options=(
        BackendOption("prefix", "--echo-prefix", help="words written before the echoed text"),
        BackendOption(
            "token_delay_s",
            "--echo-token-delay-s",
            non_negative_float,
            0.0,
            "seconds each output word takes, so that a running request can be aborted",
        ),
    ),
    context_length_keyword="context_length",
)
