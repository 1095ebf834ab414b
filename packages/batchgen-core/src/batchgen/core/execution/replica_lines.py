"""A replica's line path: one request line of a shared batch, run on the served models, one line back.

The shard runner (``work.shard_runner``) hands a replica lines as (batch id, line number) and
commits what each produced. ``LineRunner`` is that ``run_line``: it reads the line from the
batch's input (``files.batch_inputs``), checks and routes it as the single-process executor does
(``line_requests.route_line``), runs it on its model's backend, retrying a transient failure
after a backoff while attempts are left, and answers with the line to store, in the same form the
single process writes:

- a result becomes an output line (``OUTPUT``);
- a line that cannot run (invalid, an unknown or failed model), a request the backend rejects,
  one that failed transiently on every attempt, and one that raised something unexpected become
  error lines (an ``internal_error`` for the last, logged with its traceback); they go with the
  output under the user guide's convention, or to the error segments (``ERRORS``) under OpenAI's,
  ``separate_error_file``; either way they count as failed (``requests.line_outcomes``).

What says this replica cannot give the line its answer now is raised instead, and the runner
gives the shard back to the ledger, so the line runs again (here or on another replica) and is
never answered twice: an input that cannot be read (``InputGone``, ``InputChanged``, a line no
longer valid JSON), a backend that is gone (``BackendUnavailable``) and an aborted request.
"""

from __future__ import annotations

import logging

import anyio
import attrs

from batchgen.core.backends.base import (
    Backend,
    BackendUnavailable,
    Outcome,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
)
from batchgen.core.backends.served_models import ModelSet, Route
from batchgen.core.clock import now
from batchgen.core.errors import InvalidRequest
from batchgen.core.execution.line_requests import LineRefused, generation_request, route_line
from batchgen.core.files.batch_inputs import BatchInput, BatchInputs
from batchgen.core.ids import new_request_id
from batchgen.core.models import GenerationRequest, GenerationResult
from batchgen.core.requests.embeddings_api import fit_dimensions
from batchgen.core.requests.parameters import ServerDefaults
from batchgen.core.requests.results import error_line, output_line
from batchgen.core.requests.schema import Body, EmbeddingsBody, read_envelope
from batchgen.core.work.shard_runner import LineResult
from batchgen.core.work.shards import ERRORS, OUTPUT

__all__ = ["LineRunner"]

logger = logging.getLogger(__name__)


class LineRunner:
    """Runs request lines of shared batches on this replica's models (see the module)."""

    def __init__(
        self,
        models: Backend | ModelSet,
        inputs: BatchInputs,
        *,
        defaults: ServerDefaults | None = None,
        max_attempts: int = 3,
        separate_error_file: bool = False,
        backoff_s: float = 0.01,
    ) -> None:
        """``max_attempts``: tries of a request that fails transiently (the n-th retry waits
        ``backoff_s * 2**n``); ``separate_error_file``: OpenAI's convention, error lines apart."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {max_attempts!r}")
        self._models = ModelSet.of(models)
        self._inputs = inputs
        self._defaults = defaults or ServerDefaults()
        self._max_attempts = max_attempts
        self._error_kind = ERRORS if separate_error_file else OUTPUT
        self._backoff_s = backoff_s

    async def __call__(self, batch_id: str, line: int) -> LineResult:
        """What request line ``line`` of batch ``batch_id`` produced."""
        batch_input = await self._inputs.open(batch_id)
        envelope = read_envelope(await batch_input.line(line))  # InvalidRequest: the file changed
        routed = route_line(envelope, self._models)
        if isinstance(routed, LineRefused):
            return self._error(batch_input, envelope.custom_id, routed.code, routed.message)
        body, route = routed
        try:
            request = generation_request(
                new_request_id("req_"), envelope, body, route, batch_input.batch.parameters, self._defaults
            )
            outcome = await self._generate(route, request)
            if isinstance(outcome, GenerationResult):
                return self._result(batch_input, envelope.custom_id, request, body, route, outcome)
        except Exception as exc:  # a bug in this path: the line says so, the batch goes on
            outcome = exc
        if isinstance(outcome, RequestRejected):
            return self._error(batch_input, envelope.custom_id, outcome.code, outcome.message)
        if isinstance(outcome, TransientBackendError):
            message = f"The backend failed this request {self._max_attempts} times: {outcome}"
            return self._error(batch_input, envelope.custom_id, "backend_error", message)
        if isinstance(outcome, BackendUnavailable | RequestAborted):  # no line now: it runs again
            raise outcome
        logger.error("batch %s: request %r raised", batch_id, envelope.custom_id, exc_info=outcome)
        message = f"{type(outcome).__name__}: {outcome}"
        return self._error(batch_input, envelope.custom_id, "internal_error", message)

    async def _generate(self, route: Route, request: GenerationRequest) -> Outcome:
        """The request's outcome after at most ``max_attempts`` tries (a result or an exception)."""
        attempt = 1
        while True:
            try:
                return await route.model.backend.generate(request)
            except TransientBackendError as exc:
                if attempt >= self._max_attempts:
                    return exc
                logger.info("retrying %s after: %s", request.request_id, exc)
            except Exception as exc:
                return exc
            await anyio.sleep(self._backoff_s * 2**attempt)
            attempt += 1

    def _result(
        self,
        batch_input: BatchInput,
        custom_id: str,
        request: GenerationRequest,
        body: Body,
        route: Route,
        result: GenerationResult,
    ) -> LineResult:
        if isinstance(body, EmbeddingsBody):
            try:
                result = attrs.evolve(
                    result, embeddings=fit_dimensions(result.embeddings or (), body.dimensions)
                )
            except InvalidRequest as exc:
                return self._error(batch_input, custom_id, "invalid_request", exc.message)
        model_name = route.backend_model or route.model.public_name
        endpoint = batch_input.batch.endpoint
        line = output_line(custom_id, request.request_id, endpoint, model_name, result, now(), body)
        return LineResult(
            OUTPUT,
            line,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            prefix_cached_tokens=result.reported_cached_tokens,
        )

    def _error(self, batch_input: BatchInput, custom_id: str, code: str, message: str) -> LineResult:
        return LineResult(self._error_kind, error_line(custom_id, code, message, batch_input.batch.endpoint))
