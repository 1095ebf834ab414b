"""The request executor: run one admitted request and turn whatever happens into exactly one line.

A result becomes an output line; a request the backend rejects (or keeps failing transiently,
``max_attempts`` times) becomes an error line; any other exception while running it becomes an
``internal_error`` line, logged once with its traceback, so the batch goes on. An aborted request
(cancel, expiry) ends with no line. A backend that is gone fails the batch. Every path ends by
asking the tracker whether the batch is now done.
"""

from __future__ import annotations

import logging
import os
import time

import anyio
import attrs

from batchgen.core.backends.base import (
    Backend,
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
)
from batchgen.core.backends.capabilities import unsupported_problem
from batchgen.core.batch_tracker import ActiveBatch, BatchTracker, now
from batchgen.core.embeddings_api import fit_dimensions
from batchgen.core.errors import InvalidRequest
from batchgen.core.file_catalogue import FileCatalogue
from batchgen.core.ids import new_request_id
from batchgen.core.line_requests import generation_request
from batchgen.core.models import BatchStatus, GenerationRequest, GenerationResult
from batchgen.core.parameters import ServerDefaults
from batchgen.core.request_schema import Body, EmbeddingsBody, Envelope, read_body, read_envelope
from batchgen.core.results import error_line, output_line
from batchgen.core.scheduling import IntakeEntry
from batchgen.core.served_models import ModelSet, Route
from batchgen.core.storage import ResultWriter
from batchgen.core.storage_faults import storage_fault
from batchgen.core.telemetry import RequestTelemetry

logger = logging.getLogger("batchgen.service")

#: Request lines longer than this are read and decoded in a worker thread, off the event loop.
LARGE_LINE_BYTES = 1 << 20


def _read_line(fd: int, length: int, offset: int) -> Envelope:
    return read_envelope(os.pread(fd, length, offset))


class RequestExecutor:
    """Runs admitted requests on the backend and writes their lines."""

    def __init__(
        self,
        tracker: BatchTracker,
        files: FileCatalogue,
        backend: Backend | ModelSet,
        *,
        defaults: ServerDefaults,
        max_attempts: int,
        separate_error_file: bool = False,
        telemetry: RequestTelemetry | None = None,
    ) -> None:
        """``backend``: the served models (or one backend); ``separate_error_file``: OpenAI's
        convention, failed lines in their own file; ``telemetry`` counts admissions, finished
        requests and backend time."""
        self._telemetry = telemetry or RequestTelemetry()
        self._separate_error_file = separate_error_file
        self._tracker = tracker
        self._files = files
        self._models = ModelSet.of(backend)
        self._defaults = defaults
        self._max_attempts = max_attempts

    async def run(self, entry: IntakeEntry) -> None:
        """Run the request ``entry`` points at (the scheduler's ``run_request``)."""
        active = self._tracker.get(entry.batch_id)
        if active is None or active.status is not BatchStatus.IN_PROGRESS:
            return
        self._telemetry.request_admitted(entry.batch_id)
        assert active.input_fd is not None
        try:
            if entry.length > LARGE_LINE_BYTES:
                envelope = await anyio.to_thread.run_sync(
                    _read_line, active.input_fd, entry.length, entry.offset
                )
            else:
                envelope = _read_line(active.input_fd, entry.length, entry.offset)
        except Exception as exc:  # the file changed under us: no custom_id to write a line for
            logger.exception("batch %s: request line %d cannot be read back", active.id, entry.line + 1)
            self._tracker.fail(
                active,
                "batch_failed",
                f"Request line {entry.line + 1} of the input file cannot be read: {exc}",
            )
            return
        custom_id = envelope.custom_id
        request_id = new_request_id("req_")
        active.in_flight.add(request_id)
        try:
            await self._execute(active, envelope, request_id)
        except Exception as exc:
            fault = storage_fault(exc, f"record the result of request {custom_id!r}")
            if fault is not None:  # its line cannot be stored: the batch fails, as on a failed write
                logger.warning("batch %s: %s", active.id, fault.message)
                self._tracker.fail(
                    active, "batch_failed", f"{fault.message} Lines written before this are kept."
                )
            else:
                logger.exception("batch %s: request %r raised", active.id, custom_id)
                self.record_error(active, custom_id, "internal_error", f"{type(exc).__name__}: {exc}")
        finally:
            active.in_flight.discard(request_id)
            self._tracker.settle(active)

    async def _execute(self, active: ActiveBatch, envelope: Envelope, request_id: str) -> None:
        custom_id = envelope.custom_id
        try:
            # The schema upload validation used: only a file accepted by an older version (or
            # changed on disk) can fail here, and then this request gets its error line.
            body = read_body(envelope)
        except InvalidRequest as exc:
            self.record_error(active, custom_id, "invalid_request", exc.message)
            return
        # The models may have changed since upload (a restart with other flags): check again.
        try:
            route = self._models.route(body.model)
        except InvalidRequest as exc:
            self.record_error(active, custom_id, "model_not_found", exc.message)
            return
        model = route.model
        problem = unsupported_problem(
            model.public_name, getattr(model.backend, "name", "?"), model.capabilities, envelope.url, body
        )
        if problem is not None:
            self.record_error(active, custom_id, "invalid_request", problem)
            return
        if model.failure is not None:
            self.record_error(
                active, custom_id, "model_unavailable", f"model {model.public_name!r}: {model.failure}"
            )
            return
        request = generation_request(
            request_id, envelope, body, route, active.batch.parameters, self._defaults
        )
        try:
            result = await self._generate(model.backend, request)
        except RequestRejected as exc:
            self.record_error(active, custom_id, exc.code, exc.message)
        except RequestAborted:
            pass  # cancelled or expired: the request ends with no line
        except BackendUnavailable as exc:
            self._tracker.fail(active, "batch_failed", f"The inference backend became unavailable: {exc}")
        else:
            self._record_result(active, custom_id, request, result, body, route)

    async def _generate(self, backend: Backend, request: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        try:
            return await self._generate_with_retries(backend, request)
        finally:
            self._telemetry.backend_call(time.perf_counter() - started)

    async def _generate_with_retries(self, backend: Backend, request: GenerationRequest) -> GenerationResult:
        for attempt in range(1, self._max_attempts + 1):
            try:
                return await backend.generate(request)
            except TransientBackendError as exc:
                if attempt == self._max_attempts:
                    raise RequestRejected(
                        "backend_error", f"The backend failed this request {self._max_attempts} times: {exc}"
                    ) from exc
                logger.info("retrying %s after: %s", request.request_id, exc)
                await anyio.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    def _record_result(
        self,
        active: ActiveBatch,
        custom_id: str,
        request: GenerationRequest,
        result: GenerationResult,
        body: Body,
        route: Route,
    ) -> None:
        if active.status.is_terminal:
            return  # the batch ended (expired, failed) while this request ran
        if isinstance(body, EmbeddingsBody):
            try:
                vectors = fit_dimensions(result.embeddings or (), body.dimensions)
            except InvalidRequest as exc:
                self.record_error(active, custom_id, "invalid_request", exc.message)
                return
            result = attrs.evolve(result, embeddings=vectors)
        model_name = route.backend_model or route.model.public_name
        line = output_line(
            custom_id, request.request_id, active.batch.endpoint, model_name, result, now(), body
        )
        if self._write(active, active.output, line):
            active.completed += 1
            active.prompt_tokens += result.prompt_tokens
            active.completion_tokens += result.completion_tokens
            active.dirty = True
            self._telemetry.request_completed(result.prompt_tokens, result.completion_tokens)

    def record_error(self, active: ActiveBatch, custom_id: str, code: str, message: str) -> None:
        """Write the request's error line: in the output file, as the user guide has it, or in
        a separate error file (made on its first line) under OpenAI's convention."""
        if active.status.is_terminal:
            return
        writer = active.output
        if self._separate_error_file:
            writer = active.errors
            if active.batch.error_file_id is None:
                errors = self._files.register_result_file(
                    active.id,
                    active.errors.path,
                    "error",
                    expires_after_s=active.batch.output_expires_after_s,
                )
                active.batch = attrs.evolve(active.batch, error_file_id=errors.id)
                self._tracker.persist(active)
        if self._write(active, writer, error_line(custom_id, code, message)):
            active.failed += 1
            active.dirty = True
            self._telemetry.request_failed()

    def _write(self, active: ActiveBatch, writer: ResultWriter, line: bytes) -> bool:
        """Append a result line; on a storage fault fail the batch (earlier lines stay intact)."""
        try:
            writer.append(line)
        except OSError as exc:
            self._tracker.fail(
                active,
                "batch_failed",
                f"Could not write results to {writer.path}: {exc.strerror or exc}. "
                "Lines written before this are kept.",
            )
            return False
        return True
