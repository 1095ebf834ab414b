"""The Backend protocol every inference engine implements, and the errors ``generate`` may raise.

RequestRejected        this request can never succeed (e.g. context_length_exceeded): write
                       an error line, do not retry
TransientBackendError  this attempt failed; a retry may succeed
RequestAborted         the request was aborted through ``abort``
BackendUnavailable     the engine is gone; the service reports itself unhealthy
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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


class BackendUnavailable(Exception):
    pass


def context_length_exceeded(prompt_tokens: int, context_length: int) -> RequestRejected:
    """The rejection every backend raises for a prompt longer than its context."""
    return RequestRejected(
        "context_length_exceeded",
        f"Prompt length {prompt_tokens} exceeds model context {context_length}",
    )


@runtime_checkable
class Backend(Protocol):
    """One inference engine. Backends own chat templating and tokenization."""

    name: str
    model_name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> Health: ...
