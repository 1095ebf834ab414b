"""The request executor: run admitted requests and turn whatever happens to each into exactly one line.

Requests come in groups (``run_group``): their lines are read back in blocks (``line_blocks``),
each body is checked and its parameters resolved (once per batch for bodies that set none), and
each line is routed to the model it names (``served_models``; checked again, as the models may
have changed since upload), and the group's requests go to each model's backend in one call per
backend (``backends.base.generate_all``), which reports each request the moment it ends; its
line is written then, and the scheduler is told it finished.

A result becomes an output line; a request the backend rejects (or keeps failing transiently,
``max_attempts`` times) becomes an error line; any other exception while running it becomes an
``internal_error`` line, logged once with its traceback, so the batch goes on. An aborted request
(cancel, expiry) ends with no line. A backend that is gone fails the batch. Every path ends by
asking the tracker whether the batch is now done.

Lines the storage refuses (a full disk: ``storage.faults``) fail nothing and are not lost: they are
held in memory and work pauses until ``write_held`` (retried every second) has written them all
(``held_results``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import attrs

from batchgen.core.backends.base import (
    Backend,
    BackendUnavailable,
    Outcome,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
    generate_all,
)
from batchgen.core.backends.served_models import ModelSet, Route
from batchgen.core.batches.tracker import ActiveBatch, BatchTracker
from batchgen.core.clock import now
from batchgen.core.errors import InvalidRequest
from batchgen.core.execution.held_results import HeldResults, PendingLines
from batchgen.core.execution.line_requests import LineRefused, generation_request, route_line
from batchgen.core.execution.result_cache import CachedResult, ResultCache
from batchgen.core.execution.result_cache_keys import cache_key, is_deterministic
from batchgen.core.files.catalogue import FileCatalogue
from batchgen.core.files.line_blocks import read_spans
from batchgen.core.ids import new_request_id
from batchgen.core.models import BatchStatus, GenerationRequest, GenerationResult, SamplingParameters
from batchgen.core.requests.embeddings_api import fit_dimensions
from batchgen.core.requests.json_bounds import lines_within_bounds
from batchgen.core.requests.line_outcomes import LineOutcome, line_outcome
from batchgen.core.requests.parameters import ServerDefaults, resolve_sampling, sets_sampling
from batchgen.core.requests.results import (
    body_output_line,
    error_line,
    line_cached_tokens,
    output_line,
    replayed_body,
    response_body_json,
)
from batchgen.core.requests.schema import Body, EmbeddingsBody, Envelope, read_envelope
from batchgen.core.scheduling import Finished, IntakeEntry
from batchgen.core.storage import ResultWriter
from batchgen.core.storage.faults import storage_fault
from batchgen.core.telemetry import RequestTelemetry

logger = logging.getLogger("batchgen.service")

#: Request lines longer than this are read and decoded in a worker thread, off the event loop.
LARGE_LINE_BYTES = 1 << 20


def _read_line(fd: int, length: int, offset: int) -> Envelope:
    return read_envelope(os.pread(fd, length, offset))


@attrs.define(slots=True)
class _Running:
    """A request handed to the backend: where its line came from and what to report."""

    position: int
    active: ActiveBatch
    custom_id: str
    request: GenerationRequest
    body: Body
    route: Route
    ended: bool = False
    attempts: int = 1
    #: Its key in the result cache, when its tenant uses the cache and its answer is deterministic.
    cache_key: str | None = None


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
        result_cache: ResultCache | None = None,
        on_pause: Callable[[bool], object] | None = None,
    ) -> None:
        """``backend``: the served models (or one backend); ``separate_error_file``: OpenAI's
        convention, failed lines in their own file; ``telemetry`` counts admissions, finished
        requests and backend time; ``result_cache``: answers deterministic requests of the
        tenants that use it, and keeps their successful results; ``on_pause(paused)``: work
        pauses (True) while the storage refuses result lines, and resumes (False) once it takes
        them (``held_results``)."""
        #: Result lines the storage refused, until it takes them again.
        self.held = HeldResults(on_pause)
        self._cache = result_cache
        self._telemetry = telemetry or RequestTelemetry()
        self._separate_error_file = separate_error_file
        self._tracker = tracker
        self._files = files
        self._models = ModelSet.of(backend)
        self._defaults = defaults
        self._max_attempts = max_attempts

    async def run_group(self, entries: Sequence[IntakeEntry], finished: Finished) -> None:
        """Run the requests ``entries`` point at as one group (the scheduler's ``run_group``);
        ``finished(*positions)`` is called as they end (their lines written, if they have one)."""
        ended_early: list[int] = []  # not run: their batch is not running, or they have their line
        envelopes = await self._read_envelopes(entries, ended_early)
        running: list[_Running] = []
        batch_level: dict[str, SamplingParameters] = {}
        for position, active, envelope in envelopes:
            try:
                prepared = self._prepare(active, envelope, batch_level)
            except Exception as exc:
                self._record_failure(active, envelope.custom_id, exc)
                prepared = None
            if prepared is None:  # it has its line already (or the batch failed)
                self._tracker.settle(active)
                ended_early.append(position)
                continue
            request, body, route = prepared
            active.in_flight.add(request.request_id)
            item = _Running(position, active, envelope.custom_id, request, body, route)
            if self._cache is not None:
                item.cache_key = self._cache_key(item, envelope)
            running.append(item)
        if self._cache is not None and running:
            running = self._answer_from_cache(self._cache, running, ended_early)
        finished(*ended_early)
        if not running:
            return
        reported = _Reported(time.perf_counter())
        try:
            async with anyio.create_task_group() as helpers:
                helpers.start_soon(self._end_when_reported, reported, helpers, finished)
                try:
                    await self._generate_per_backend(running, reported)
                finally:
                    self._end_all(reported.take(), helpers, finished, reported.started)
                    reported.close()
        finally:
            for item in running:
                if not item.ended:  # cancelled (shutdown): abandoned with no line, rerun on restart
                    item.active.in_flight.discard(item.request.request_id)
                    self._tracker.settle(item.active)

    def _cache_key(self, item: _Running, envelope: Envelope) -> str | None:
        """The request's key in the result cache; None when it must run (its tenant does not use
        the cache, or its answer may differ next time)."""
        assert self._cache is not None
        tenant = item.active.batch.owner
        model = item.route.model
        if not self._cache.enabled_for(tenant) or not is_deterministic(item.request, model.capabilities):
            return None
        identity = (model.public_name, getattr(model.backend, "name", "?"), item.route.backend_model or "")
        return cache_key(tenant, identity, envelope.url, bytes(envelope.body), item.request)

    def _answer_from_cache(
        self, cache: ResultCache, running: list[_Running], ended_early: list[int]
    ) -> list[_Running]:
        """Write the lines of the requests the cache holds (their bodies replayed byte for byte
        but for ``cached_tokens``, all their prompt, ``replayed_body``; the line's own id and
        custom_id this batch's); the others, still to run."""
        keys = [item.cache_key for item in running if item.cache_key is not None]
        if not keys:
            return running
        found = cache.lookup(keys)
        if not found:
            return running
        lines = _Lines(self._telemetry, cache)
        left: list[_Running] = []
        answered: list[_Running] = []
        for item in running:
            hit = None if item.cache_key is None else found.get(item.cache_key)
            if hit is None:
                left.append(item)
                continue
            answered.append(item)
            body = replayed_body(item.active.batch.endpoint, hit.body, hit.prompt_tokens)
            line = body_output_line(item.custom_id, item.request.request_id, body, cached=True)
            lines.add(
                item.active, item.active.output, line, None, cached=hit, request_id=item.request.request_id
            )
        try:
            lines.write(self._write)
        finally:
            for item in answered:
                item.ended = True
                self._release(item)
                ended_early.append(item.position)
        return left

    @staticmethod
    async def _generate_per_backend(running: list[_Running], reported: _Reported) -> None:
        """Hand the group to its models' backends: one ``generate_all`` call per backend, the
        calls running side by side."""

        async def generate(backend: Backend, items: list[_Running]) -> None:
            await generate_all(
                backend,
                [item.request for item in items],
                lambda index, outcome: reported.add(items[index], outcome),
            )

        first = running[0].route.model.backend
        if all(item.route.model.backend is first for item in running):  # the usual case: no task
            await generate(first, running)
            return
        by_backend: dict[int, tuple[Backend, list[_Running]]] = {}
        for item in running:
            backend = item.route.model.backend
            by_backend.setdefault(id(backend), (backend, []))[1].append(item)
        async with anyio.create_task_group() as calls:
            for backend, items in by_backend.values():
                calls.start_soon(generate, backend, items)

    async def _read_envelopes(
        self, entries: Sequence[IntakeEntry], ended_early: list[int]
    ) -> list[tuple[int, ActiveBatch, Envelope]]:
        """The envelopes of the entries whose batch is running, read back in blocks per batch;
        the other entries are finished at once (with no line). A line that cannot be read back
        fails its batch."""
        by_batch: dict[str, list[int]] = {}
        actives: dict[str, ActiveBatch] = {}
        for position, entry in enumerate(entries):
            active = self._tracker.get(entry.batch_id)
            if active is None or active.status is not BatchStatus.IN_PROGRESS:
                ended_early.append(position)
                continue
            actives[entry.batch_id] = active
            by_batch.setdefault(entry.batch_id, []).append(position)
        for batch_id, positions in by_batch.items():
            self._telemetry.requests_admitted(batch_id, len(positions))
        envelopes: list[tuple[int, ActiveBatch, Envelope]] = []
        for batch_id, positions in by_batch.items():
            active = actives[batch_id]
            for position, envelope in await self._read_batch_lines(active, entries, positions):
                if envelope is None:
                    ended_early.append(position)
                else:
                    envelopes.append((position, active, envelope))
        return envelopes

    async def _read_batch_lines(
        self, active: ActiveBatch, entries: Sequence[IntakeEntry], positions: list[int]
    ) -> list[tuple[int, Envelope | None]]:
        small = [position for position in positions if entries[position].length <= LARGE_LINE_BYTES]
        read: list[tuple[int, Envelope | None]] = []
        position = positions[0]
        try:
            if active.input_fd is None or active.status is not BatchStatus.IN_PROGRESS:
                return [(position, None) for position in positions]
            if small:
                raws = read_spans(
                    active.input_fd,
                    [(entries[position].offset, entries[position].length) for position in small],
                )
                within_bounds = lines_within_bounds(b"\n".join(raws))  # one look for all
                for position, raw in zip(small, raws, strict=True):
                    read.append((position, read_envelope(raw, within_bounds=within_bounds)))
            for position in positions:
                entry = entries[position]
                if entry.length > LARGE_LINE_BYTES and active.input_fd is not None:
                    envelope = await anyio.to_thread.run_sync(
                        _read_line, active.input_fd, entry.length, entry.offset
                    )
                    read.append((position, envelope))
        except Exception as exc:  # the file changed under us: no custom_id to write a line for
            line = entries[position].line + 1
            logger.exception("batch %s: request line %d cannot be read back", active.id, line)
            self._tracker.fail(
                active, "batch_failed", f"Request line {line} of the input file cannot be read: {exc}"
            )
            return [(position, None) for position in positions]
        if len(read) < len(positions):  # the batch ended while a large line was read
            done = {position for position, _ in read}
            read.extend((position, None) for position in positions if position not in done)
        return read

    def _prepare(
        self, active: ActiveBatch, envelope: Envelope, batch_level: dict[str, SamplingParameters]
    ) -> tuple[GenerationRequest, Body, Route] | None:
        """The request a line asks for, with its body and route; None once its error line is written."""
        routed = route_line(envelope, self._models)
        if isinstance(routed, LineRefused):
            self.record_error(active, envelope.custom_id, routed.code, routed.message)
            return None
        body, route = routed
        sampling = None
        if not isinstance(body, EmbeddingsBody) and not sets_sampling(body):
            # every such line of the batch resolves alike: once per group
            sampling = batch_level.get(active.id)
            if sampling is None:
                sampling = batch_level[active.id] = resolve_sampling(
                    body, active.batch.parameters, self._defaults
                )
        request = generation_request(
            new_request_id("req_"),
            envelope,
            body,
            route,
            active.batch.parameters,
            self._defaults,
            sampling=sampling,
        )
        return request, body, route

    async def _end_when_reported(
        self, reported: _Reported, helpers: anyio.abc.TaskGroup, finished: Finished
    ) -> None:
        """End what the backend reports while the group waits, a turn of the loop's worth at a time."""
        while await reported.wait():
            self._end_all(reported.take(), helpers, finished, reported.started)

    def _end_all(
        self,
        items: list[tuple[_Running, Outcome]],
        helpers: anyio.abc.TaskGroup,
        finished: Finished,
        started: float,
    ) -> None:
        """End requests the backend has reported: retry those that failed transiently (while
        attempts are left), write the lines the others call for, one write per result file, then
        release each of them however that went. ``started``: when they went to the backend."""
        if not items:
            return
        lines = _Lines(self._telemetry, self._cache)
        ending: list[tuple[_Running, Outcome]] = []
        try:
            for item, outcome in items:
                if isinstance(outcome, TransientBackendError) and item.attempts < self._max_attempts:
                    helpers.start_soon(self._retry, item, outcome, helpers, finished, started)
                    continue
                ending.append((item, outcome))
                try:
                    self._add_line(item, outcome, lines)
                except Exception as exc:
                    self._record_failure(item.active, item.custom_id, exc)
            self._telemetry.backend_calls(time.perf_counter() - started, len(ending))
            lines.write(self._write)
            for item, outcome in ending:  # after the lines of those that finished
                if isinstance(outcome, BackendUnavailable):
                    message = f"The inference backend became unavailable: {outcome}"
                    self._tracker.fail(item.active, "batch_failed", message)
        finally:
            for item, _ in ending:
                item.ended = True
                self._release(item)
            finished(*(item.position for item, _ in ending))

    def _release(self, item: _Running) -> None:
        """A request ended: it leaves its batch's ``in_flight`` (once its line is written, when
        its line is held), and the batch may be done."""
        if not self.held.holds(item.request.request_id):
            item.active.in_flight.discard(item.request.request_id)
        self._tracker.settle(item.active)

    def _add_line(self, item: _Running, outcome: Outcome, lines: _Lines) -> None:
        """Add the line ``outcome`` calls for to ``lines`` (none when aborted or the backend is gone)."""
        active, custom_id = item.active, item.custom_id
        if isinstance(outcome, GenerationResult):
            if not active.status.is_terminal:  # else it ended (expired, failed) while this request ran
                self._add_result(item, outcome, lines)
        elif isinstance(outcome, RequestRejected):
            self._add_error(active, custom_id, outcome.code, outcome.message, lines, item.request.request_id)
        elif isinstance(outcome, TransientBackendError):  # the last attempt failed too
            message = f"The backend failed this request {self._max_attempts} times: {outcome}"
            self._add_error(active, custom_id, "backend_error", message, lines, item.request.request_id)
        elif not isinstance(outcome, RequestAborted | BackendUnavailable):  # aborted: no line
            raise outcome

    def _add_result(self, item: _Running, result: GenerationResult, lines: _Lines) -> None:
        """Add a result's output line (an embeddings result cut to the dimensions asked for;
        an error line when it cannot be)."""
        active, custom_id, body, route = item.active, item.custom_id, item.body, item.route
        if isinstance(body, EmbeddingsBody):
            try:
                vectors = fit_dimensions(result.embeddings or (), body.dimensions)
            except InvalidRequest as exc:
                self._add_error(
                    active, custom_id, "invalid_request", exc.message, lines, item.request.request_id
                )
                return
            result = attrs.evolve(result, embeddings=vectors)
        model_name = route.backend_model or route.model.public_name
        if item.cache_key is None:
            line = output_line(
                custom_id, item.request.request_id, active.batch.endpoint, model_name, result, now(), body
            )
            lines.add(active, active.output, line, result, request_id=item.request.request_id)
            return
        # kept in the cache exactly as the line holds it, once the line is written
        body_json = response_body_json(active.batch.endpoint, model_name, result, now(), body)
        line = body_output_line(custom_id, item.request.request_id, body_json)
        entry = (
            item.cache_key,
            active.batch.owner,
            CachedResult(body_json, result.prompt_tokens, result.completion_tokens),
        )
        lines.add(active, active.output, line, result, store=entry, request_id=item.request.request_id)

    def _record_failure(self, active: ActiveBatch, custom_id: str, exc: Exception) -> None:
        """A request raised something unexpected: its line says so, or, when its line cannot be
        stored, the batch fails."""
        fault = storage_fault(exc, f"record the result of request {custom_id!r}")
        if fault is not None:  # its line cannot be stored: the batch fails, as on a failed write
            logger.warning("batch %s: %s", active.id, fault.message)
            self._tracker.fail(active, "batch_failed", f"{fault.message} Lines written before this are kept.")
            return
        logger.error("batch %s: request %r raised", active.id, custom_id, exc_info=exc)
        try:
            self.record_error(active, custom_id, "internal_error", f"{type(exc).__name__}: {exc}")
        except Exception:
            logger.exception("batch %s: the error line of request %r cannot be written", active.id, custom_id)

    async def _retry(
        self,
        item: _Running,
        error: TransientBackendError,
        helpers: anyio.abc.TaskGroup,
        finished: Finished,
        started: float,
    ) -> None:
        """The next attempt at a request that failed transiently, after a backoff."""
        logger.info("retrying %s after: %s", item.request.request_id, error)
        await anyio.sleep(0.01 * 2**item.attempts)
        item.attempts += 1
        try:
            outcome: Outcome = await item.route.model.backend.generate(item.request)
        except Exception as exc:
            outcome = exc
        self._end_all([(item, outcome)], helpers, finished, started)

    def record_error(self, active: ActiveBatch, custom_id: str, code: str, message: str) -> None:
        """Write the request's error line now (see ``_add_error``)."""
        lines = _Lines(self._telemetry, None)
        self._add_error(active, custom_id, code, message, lines)
        lines.write(self._write)

    def _add_error(
        self,
        active: ActiveBatch,
        custom_id: str,
        code: str,
        message: str,
        lines: _Lines,
        request_id: str | None = None,
    ) -> None:
        """Add the request's error line: for the output file, as the user guide has it, or for a
        separate error file (made on its first line) under OpenAI's convention. ``request_id``:
        the request's, when it ran."""
        if active.status.is_terminal:
            return
        writer = active.output
        if self._separate_error_file:
            writer = active.errors
            if active.batch.error_file_id is None:
                # recorded now; while another process holds the database locked, with the batch's
                # next save once the lock is gone (the line goes to disk now either way)
                errors = self._files.result_file(active.batch, active.errors.path, "error")
                self._tracker.record_file(active, errors, "error")
                self._tracker.persist(active)
        line = error_line(custom_id, code, message, active.batch.endpoint)
        lines.add(active, writer, line, None, request_id=request_id)

    def _write(self, pending: PendingLines) -> bool:
        """Append result lines; whether they are written now. On a storage fault (a full disk)
        they are held and work pauses until ``write_held`` writes them; on any other error the
        batch fails (earlier lines stay intact)."""
        if self.held.paused:  # behind the lines held already: written in turn
            self.held.hold(pending)
            return False
        try:
            pending.writer.append(pending.data)
        except OSError as exc:
            fault = storage_fault(exc, f"write results to {pending.writer.path}")
            if fault is None:
                self._fail_write(pending, exc)
            else:
                self.held.hold(pending, fault)
            return False
        return True

    def _fail_write(self, pending: PendingLines, exc: OSError) -> None:
        self._tracker.fail(
            pending.active,
            "batch_failed",
            f"Could not write results to {pending.writer.path}: {exc.strerror or exc}. "
            "Lines written before this are kept.",
        )

    def write_held(self) -> None:
        """Append the lines the storage refused, oldest first, counting each file's once written;
        once all are written work resumes. Raise the storage fault while it still refuses them
        (a maintenance job runs this every ``held_results.RETRY_INTERVAL_S``)."""
        held = self.held
        while (pending := held.oldest()) is not None:
            if not pending.active.status.is_terminal:  # else its batch ended: no line is added now
                try:
                    pending.writer.append(pending.data)
                except OSError as exc:
                    fault = storage_fault(exc, f"write results to {pending.writer.path}")
                    if fault is not None:
                        held.refused(fault)
                        raise fault from exc
                    held.release_oldest()
                    self._fail_write(pending, exc)
                    self._settle_released(pending)
                    continue
                pending.count()
            held.release_oldest()
            self._settle_released(pending)
        held.resume_if_empty()

    def _settle_released(self, pending: PendingLines) -> None:
        """Held lines left the hold: their requests leave ``in_flight``, and the batch may be done."""
        for request_id in pending.request_ids:
            pending.active.in_flight.discard(request_id)
        self._tracker.settle(pending.active)


class _Reported:
    """Outcomes the backend has reported and the group has not ended yet.

    ``add`` may be called from anywhere on the event loop's thread (a timer callback, say); the
    group's own tasks ``wait`` for outcomes and ``take`` them, so the lines of requests reported in
    the same turn of the loop are written together.
    """

    def __init__(self, started: float) -> None:
        #: When the group was handed to the backend (``perf_counter``).
        self.started = started
        self._items: list[tuple[_Running, Outcome]] = []
        self._closed = False
        self._wake = anyio.Event()

    def add(self, item: _Running, outcome: Outcome) -> None:
        if not self._items:
            self._wake.set()
        self._items.append((item, outcome))

    def take(self) -> list[tuple[_Running, Outcome]]:
        items, self._items = self._items, []
        return items

    def close(self) -> None:
        """Nothing more will be reported: ``wait`` returns False once all is taken."""
        self._closed = True
        self._wake.set()

    async def wait(self) -> bool:
        """Wait until something is reported (True) or the group is closed (False)."""
        while not self._items:
            if self._closed:
                return False
            await self._wake.wait()
            self._wake = anyio.Event()
        return True


#: What a result line adds to the result cache once written: (key, tenant, the entry).
_CacheEntry = tuple[str, str, CachedResult]


class _Lines:
    """Result lines of requests that ended together, written with one append per result file.

    Each request's counters move only once its line is written; a batch that has ended by then
    gets none of them. So do the result cache's: a replayed line counts as a hit, and a computed
    result is stored, only once its line is written.
    """

    def __init__(self, telemetry: RequestTelemetry, cache: ResultCache | None) -> None:
        self._telemetry = telemetry
        self._cache = cache
        self._files: dict[
            int,
            tuple[
                ActiveBatch,
                ResultWriter,
                list[bytes],
                list[tuple[GenerationResult | None, CachedResult | None, _CacheEntry | None]],
                list[str],
            ],
        ] = {}

    def add(
        self,
        active: ActiveBatch,
        writer: ResultWriter,
        line: bytes,
        result: GenerationResult | None,
        *,
        cached: CachedResult | None = None,
        store: _CacheEntry | None = None,
        request_id: str | None = None,
    ) -> None:
        """A result's output line (``result``), a line the cache answered (``cached``), or an
        error line (neither); ``store``: the cache entry the result makes; ``request_id``: the
        request's, when it ran."""
        pending = self._files.get(id(writer))
        if pending is None:
            pending = self._files[id(writer)] = (active, writer, [], [], [])
        pending[2].append(line)
        pending[3].append((result, cached, store))
        if request_id is not None:
            pending[4].append(request_id)

    def write(self, append: Callable[[PendingLines], bool]) -> None:
        """Hand each file's lines to ``append``, and count them once it says they are written
        (lines it holds are counted when they are written later)."""
        for active, writer, lines, results, request_ids in self._files.values():
            if active.status.is_terminal:
                continue
            count = functools.partial(self._count, active, lines, results)
            pending = PendingLines(active, writer, b"".join(lines), len(lines), tuple(request_ids), count)
            if append(pending):
                count()

    def _count(
        self,
        active: ActiveBatch,
        lines: list[bytes],
        results: list[tuple[GenerationResult | None, CachedResult | None, _CacheEntry | None]],
    ) -> None:
        """Move the batch's counters, the telemetry and the result cache for lines just written
        (none when the batch ended meanwhile)."""
        if active.status.is_terminal:
            return
        stores: list[_CacheEntry] = []
        telemetry = self._telemetry
        for line, (result, cached, store) in zip(lines, results, strict=True):
            if line_outcome(line) is LineOutcome.FAILED:  # the one rule both topologies count by
                active.failed += 1
                telemetry.request_failed()
                continue
            active.completed += 1
            if cached is not None:
                active.prompt_tokens += cached.prompt_tokens
                active.completion_tokens += cached.completion_tokens
                active.cached += 1
                active.cached_prompt_tokens += cached.prompt_tokens
                active.cached_completion_tokens += cached.completion_tokens
                telemetry.request_completed(0, 0)  # nothing was computed for it
                if self._cache is not None:
                    self._cache.served(cached)
            elif result is not None:
                active.prompt_tokens += result.prompt_tokens
                active.completion_tokens += result.completion_tokens
                prefix_cached = line_cached_tokens(active.batch.endpoint, result)  # as the line says
                active.prefix_cached_tokens += prefix_cached
                telemetry.request_completed(result.prompt_tokens, result.completion_tokens, prefix_cached)
                if store is not None:
                    stores.append(store)
        active.dirty = True
        if stores and self._cache is not None:
            self._cache.store_later(stores)
