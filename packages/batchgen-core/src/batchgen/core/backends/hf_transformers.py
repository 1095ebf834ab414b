"""TransformersBackend: a real model run with torch + transformers in a worker process of its own.

The default backend, and the one for a machine without SGLang: with no ``model`` it serves
SmolLM2-135M-Instruct on the CPU (CUDA when present). The model loop runs in a separate process
(``hf_worker``), as SGLang and vLLM run theirs apart from their API servers, so the HTTP side
(event loop, JSON, polling clients) never holds the GIL the model loop needs; this process never
imports torch. Requests go to the worker through a pipe; results and token counts come back.

The worker generates with continuous batching (``hf_decode``): up to ``max_batch_size`` requests
run together, each with its own sampling settings and output limit, and a finished row's place is
taken by a waiting request at the next step. It honours ``response_format`` (a grammar per row,
``hf_grammar``), ``logprobs``/``top_logprobs`` and ``n`` up to ``MAX_CHOICES`` (``hf_choices``). The model computes in ``dtype`` (``auto``: bfloat16 on
CUDA and on CPUs with native bfloat16 instructions, float32 on other CPUs; see ``hf_dtype``).

Health comes from the worker's heartbeat. A worker that dies (a crash, the OOM killer, SIGKILL)
is restarted, and the requests it was running are sent to the new one, so every ``generate``
call still returns once: the service writes each request's line once. A request that was running
in ``MAX_WORKER_DEATHS`` workers that died fails with ``TransientBackendError``; a worker that
cannot be started again makes the backend unhealthy. A worker whose heartbeat stops for
``heartbeat_timeout_s`` is killed and restarted the same way.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs

from batchgen.core.backends.base import (
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
)
from batchgen.core.backends.capabilities import (
    CHOICES,
    FREQUENCY_PENALTY,
    GREEDY,
    LOGIT_BIAS,
    LOGPROBS,
    PRESENCE_PENALTY,
    RESPONSE_FORMAT,
    SEEDED,
    Capabilities,
)
from batchgen.core.backends.engine_activity import EngineActivity
from batchgen.core.backends.hf_choices import MAX_CHOICES
from batchgen.core.backends.hf_decode import ABORTED, REJECTED, EngineInfo, Outcome
from batchgen.core.backends.hf_dtype import DTYPE_CHOICES, DTYPE_OPTION
from batchgen.core.backends.hf_grammar_bounds import DEFAULT_BOUNDS
from batchgen.core.backends.hf_model_files import MODEL_OPTION
from batchgen.core.backends.hf_worker import HEARTBEAT_S, WorkerOptions
from batchgen.core.backends.option_types import positive_int
from batchgen.core.backends.spec import BackendOption, BackendSpec
from batchgen.core.models import GenerationRequest, GenerationResult, Health

logger = logging.getLogger("batchgen.backends.transformers")

#: A request that was running in this many workers that died is failed (the service may retry it).
MAX_WORKER_DEATHS = 3
#: How long ``stop`` waits for the worker to exit before it kills it.
STOP_WAIT_S = 15.0
#: How long a heartbeat may be late before ``health`` says so.
HEARTBEAT_LATE_S = 10 * HEARTBEAT_S
#: How long one turn of the worker's model loop (a step, or taking in new requests) may last
#: before ``health`` says the loop is stalled (nothing known can stall it that long: grammars
#: compile off the loop, and every per-line cost is bounded).
STALLED_TURN_S = 120.0


@attrs.define(eq=False)
class _Pending:
    """One request sent to the worker, until its outcome comes back."""

    request: GenerationRequest
    done: anyio.Event
    result: GenerationResult | None = None
    error: BaseException | None = None
    aborted: bool = False
    worker_deaths: int = 0


@attrs.define(eq=False)
class _Worker:
    """A started worker process and the server's end of its pipe."""

    process: subprocess.Popen[bytes]
    connection: Connection

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)


class TransformersBackend:
    name = "transformers"
    #: Structured output (``hf_grammar``), logprobs and several choices (``hf_choices``), and
    #: ``logit_bias`` and the penalties (``hf_decode``).
    capabilities = Capabilities(
        features=frozenset(
            {RESPONSE_FORMAT, LOGPROBS, CHOICES, LOGIT_BIAS, FREQUENCY_PENALTY, PRESENCE_PENALTY}
        ),
        max_choices=MAX_CHOICES,
        deterministic=frozenset({GREEDY, SEEDED}),  # a seeded row samples from its own generator
    )

    def __init__(
        self,
        *,
        model: str | None = None,
        cache_dir: Path | str = Path("batchgen-data") / "models",
        device: str | None = None,
        max_batch_size: int = 64,
        context_length: int | None = None,
        dtype: str = "auto",
        start_timeout_s: float = 900.0,
        heartbeat_timeout_s: float = 60.0,
        grammar_compile_timeout_s: float = DEFAULT_BOUNDS.compile_timeout_s,
        grammar_max_schema_bytes: int = DEFAULT_BOUNDS.max_schema_bytes,
        grammar_max_properties: int = DEFAULT_BOUNDS.max_properties,
        grammar_max_enum_values: int = DEFAULT_BOUNDS.max_enum_values,
        grammar_max_depth: int = DEFAULT_BOUNDS.max_depth,
        grammar_cache_size: int = DEFAULT_BOUNDS.cache_size,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        #: What the worker process is started with (the backend's options).
        self.worker_options = WorkerOptions(
            model=model,
            cache_dir=str(cache_dir),
            device=device,
            dtype=dtype,
            max_batch_size=max_batch_size,
            context_length=context_length,
            grammar_compile_timeout_s=grammar_compile_timeout_s,
            grammar_max_schema_bytes=grammar_max_schema_bytes,
            grammar_max_properties=grammar_max_properties,
            grammar_max_enum_values=grammar_max_enum_values,
            grammar_max_depth=grammar_max_depth,
            grammar_cache_size=grammar_cache_size,
        )
        self.max_batch_size = max_batch_size
        self._start_timeout_s = start_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.model_name = "SmolLM2-135M-Instruct" if model is None else Path(model).stem
        self.context_length = context_length or 0
        self.info: EngineInfo | None = None
        self.worker_restarts = 0
        self._pending: dict[str, _Pending] = {}
        self._worker: _Worker | None = None
        self._send_lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        self._token: Any = None
        self._failure: str | None = None
        self._restarting = False
        self._stopping = False
        self._last_heard = 0.0
        self._turn_s = 0.0  # how long the worker's model loop was in its turn, at its last heartbeat
        # From the heartbeats: requests in the worker's running batch, tokens it generated, and
        # the tokens of the workers before it (a restarted worker counts from 0 again).
        self._engine_running = 0
        self._worker_tokens = 0
        self._earlier_tokens = 0
        self._loading: _Worker | None = None  # a worker still loading its model

    @property
    def worker_pid(self) -> int | None:
        """The worker process's id (None while there is none)."""
        return None if self._worker is None else self._worker.pid

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._supervisor is not None or self._stopping:
            return
        self._token = anyio.lowlevel.current_token()
        try:
            worker = await anyio.to_thread.run_sync(self._launch, abandon_on_cancel=True)
        except BackendUnavailable as exc:
            self._failure = str(exc)
            raise
        self._worker = worker
        # The supervisor thread reads the worker's messages and starts any later worker. It is made
        # here, before the server lowers its own priority (``batchgen.server.priority``), so a
        # restarted worker keeps the priority the first one had.
        self._supervisor = threading.Thread(target=self._supervise, name="batchgen-transformers", daemon=True)
        self._supervisor.start()

    def _launch(self) -> _Worker:
        """Start a worker process and wait until its model is loaded."""
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                self.worker_options.command(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        worker = _Worker(process, Connection(ours.detach()))
        self._loading = worker
        deadline = time.monotonic() + self._start_timeout_s
        try:
            while time.monotonic() < deadline:
                if not worker.connection.poll(0.5):
                    if process.poll() is not None:
                        raise BackendUnavailable(
                            f"the transformers worker exited with status {process.returncode} while "
                            "loading the model (its log is above)"
                        )
                    continue
                message = worker.connection.recv()
                if message[0] == "ready":
                    self._ready(message[1], process.pid)
                    return worker
                if message[0] == "failed":
                    raise BackendUnavailable(f"the transformers model could not be loaded: {message[1]}")
            raise BackendUnavailable(
                f"the transformers worker did not load its model within {self._start_timeout_s:.0f} s"
            )
        except BaseException:
            worker.kill()
            process.wait()
            worker.connection.close()
            raise
        finally:
            self._loading = None

    def _ready(self, info: EngineInfo, pid: int) -> None:
        self._earlier_tokens += self._worker_tokens  # a new worker counts its tokens from 0
        self._worker_tokens = self._engine_running = 0
        self.info = info
        self.model_name = info.model_name
        self.context_length = info.context_length
        self._last_heard = time.monotonic()
        logger.info(
            "serving %s on %s in %s (context %d, batches of up to %d) in worker process %d",
            info.model_name,
            info.device,
            info.dtype,
            info.context_length,
            self.max_batch_size,
            pid,
        )

    async def stop(self) -> None:
        """Abort what is running, ask the worker to exit, and wait for it (killing it if it hangs)."""
        self._stopping = True
        for pending in self._pending.values():
            pending.aborted = True
        worker, supervisor = self._worker, self._supervisor
        if worker is None or supervisor is None:
            return
        self._send(("stop",))
        # Shielded: a shutdown that is being cancelled still waits (boundedly) for the worker to
        # exit, so that no worker outlives the server.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(supervisor.join, STOP_WAIT_S)
            if supervisor.is_alive():
                for hung in (self._worker, self._loading):
                    if hung is not None:
                        hung.kill()
                await anyio.to_thread.run_sync(supervisor.join, STOP_WAIT_S)
        self._worker = None

    @property
    def cpu_worker(self) -> bool:
        """Whether the model computes on this machine's CPU in a worker process apart from the
        server (known once it is loaded): then the server's API can yield the CPU to it entirely
        (``--api-nice auto``)."""
        return self.info is not None and str(self.info.device).startswith("cpu")

    def health(self) -> Health:
        if self._failure is not None:
            return Health(False, self._failure)
        if self._worker is None or self._stopping:
            return Health(False, "the transformers model is not loaded")
        if self._restarting:
            return Health(False, "the transformers worker died; a new one is loading the model")
        silent_s = time.monotonic() - self._last_heard
        if silent_s > HEARTBEAT_LATE_S:
            return Health(False, f"no heartbeat from the transformers worker for {silent_s:.0f} s")
        if self._turn_s > STALLED_TURN_S:
            return Health(
                False, f"the transformers worker's model loop has been in one step for {self._turn_s:.0f} s"
            )
        return Health(True)

    def engine_activity(self) -> EngineActivity:
        """The requests in the worker's running batch and the tokens generated since start, as of
        its last heartbeat (once a second): ``backends.engine_activity``."""
        # A request that ended since the last heartbeat is not running any more.
        running = 0 if self._worker is None else min(self._engine_running, len(self._pending))
        return EngineActivity(running=running, generated_tokens=self._earlier_tokens + self._worker_tokens)

    # --- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._failure is not None:
            raise BackendUnavailable(self._failure)
        if self._worker is None or self._stopping:
            raise BackendUnavailable("the transformers model is not loaded; start the backend first")
        pending = _Pending(request, anyio.Event())
        with self._send_lock:  # a restart resends what is pending: never both, never neither
            self._pending[request.request_id] = pending
            self._send_locked(("submit", request))
        try:
            await pending.done.wait()
        except BaseException:
            pending.aborted = True  # the caller went away (shutdown): stop generating for it
            self._send(("abort", request.request_id))
            raise
        finally:
            self._pending.pop(request.request_id, None)
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    async def abort(self, request_id: str) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.aborted = True
            self._send(("abort", request_id))

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._send_locked(message)

    def _send_locked(self, message: tuple[Any, ...]) -> None:
        """Send to the worker; a worker that is gone is noticed (and replaced) by the supervisor."""
        if self._worker is not None:
            with contextlib.suppress(OSError):
                self._worker.connection.send(message)

    # --- the supervisor thread ------------------------------------------------------------
    def _supervise(self) -> None:
        while True:
            worker = self._worker
            assert worker is not None
            if self._stopping:  # stop() may have written to the worker this one replaced
                self._send(("stop",))
            self._read_until_gone(worker)
            worker.kill()
            status = worker.process.wait()
            worker.connection.close()
            if self._stopping:
                self._finish_all(lambda pending: RequestAborted(pending.request.request_id))
                return
            logger.warning(
                "the transformers worker (pid %d) ended with status %s; starting a new one and "
                "sending it the %d requests it was running",
                worker.pid,
                status,
                len(self._pending),
            )
            if not self._restart():
                return

    def _read_until_gone(self, worker: _Worker) -> None:
        """Handle the worker's messages until its pipe closes; kill it if its heartbeat stops."""
        try:
            while True:
                if not worker.connection.poll(HEARTBEAT_S):
                    if time.monotonic() - self._last_heard > self._heartbeat_timeout_s:
                        logger.warning(
                            "no heartbeat from the transformers worker for %.0f s; killing it",
                            self._heartbeat_timeout_s,
                        )
                        return
                    continue
                message = worker.connection.recv()
                self._last_heard = time.monotonic()
                if message[0] == "done":
                    self._deliver(message[1])
                elif message[0] == "heartbeat":
                    self._turn_s = float(message[1]) if len(message) > 1 else 0.0
                    if len(message) > 3:
                        self._engine_running, self._worker_tokens = int(message[2]), int(message[3])
        except (EOFError, OSError):
            return

    def _restart(self) -> bool:
        """Start a new worker and resend the pending requests to it; False when none could start."""
        self._restarting = True
        self.worker_restarts += 1
        try:
            worker = self._launch()
        except BackendUnavailable as exc:
            self._failure = f"the transformers worker died and could not be started again: {exc}"
            logger.error("%s", self._failure)
            self._finish_all(lambda _: BackendUnavailable(self._failure))
            return False
        finished: list[_Pending] = []
        with self._send_lock:
            self._worker = worker
            for pending in list(self._pending.values()):
                pending.worker_deaths += 1
                if pending.aborted:
                    pending.error = RequestAborted(pending.request.request_id)
                elif pending.worker_deaths >= MAX_WORKER_DEATHS:
                    pending.error = TransientBackendError(
                        f"the transformers worker died {pending.worker_deaths} times while running this request"
                    )
                else:
                    self._send_locked(("submit", pending.request))
                    continue
                finished.append(pending)
        self._restarting = False
        self._wake(finished)
        return True

    def _deliver(self, outcomes: list[Outcome]) -> None:
        finished = []
        for outcome in outcomes:
            pending = self._pending.get(outcome.request_id)
            if pending is None or pending.done.is_set():
                continue  # its caller went away
            if outcome.result is not None:
                pending.result = outcome.result
            else:
                pending.error = self._error(pending, outcome)
            finished.append(pending)
        self._wake(finished)

    def _error(self, pending: _Pending, outcome: Outcome) -> BaseException:
        failure = outcome.failure
        assert failure is not None
        if failure.kind == REJECTED:
            return RequestRejected(failure.code, failure.message)
        if failure.kind == ABORTED or pending.aborted or self._stopping:
            return RequestAborted(pending.request.request_id)
        return TransientBackendError(failure.message)

    def _finish_all(self, error: Any) -> None:
        finished = list(self._pending.values())
        for pending in finished:
            pending.error = error(pending)
        self._wake(finished)

    def _wake(self, finished: list[_Pending]) -> None:
        """Wake the waiting coroutines, from this thread, on the event loop."""
        if not finished:
            return

        def wake() -> None:
            for pending in finished:
                pending.done.set()

        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody waits
            anyio.from_thread.run_sync(wake, token=self._token)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be more than 0 seconds, got {text}")
    return value


SPEC = BackendSpec(
    name="transformers",
    factory=TransformersBackend,
    summary="runs a model with torch + transformers in a worker process (CPU, or CUDA when present)",
    options=(
        MODEL_OPTION,
        BackendOption("device", "--device", help="torch device", default_help="cuda if present, else cpu"),
        BackendOption(
            "max_batch_size",
            "--max-batch-size",
            positive_int,
            64,
            "most requests generated together (continuous batching: a finished request's place is "
            "taken by a waiting one at the next token)",
        ),
        DTYPE_OPTION,
        BackendOption(
            "grammar_compile_timeout_s",
            "--grammar-compile-timeout",
            _positive_seconds,
            DEFAULT_BOUNDS.compile_timeout_s,
            "seconds one response_format schema may take to compile into a grammar (off the decode "
            "loop, in a process killed at the deadline); a slower schema is its line's error",
            metavar="SECONDS",
        ),
        BackendOption(
            "grammar_max_schema_bytes",
            "--grammar-max-schema-bytes",
            positive_int,
            DEFAULT_BOUNDS.max_schema_bytes,
            "largest response_format JSON schema, in bytes of compact JSON; a larger one is its line's error",
            metavar="BYTES",
        ),
        BackendOption(
            "grammar_max_properties",
            "--grammar-max-properties",
            positive_int,
            DEFAULT_BOUNDS.max_properties,
            "most object properties in one response_format schema, all objects together",
            metavar="N",
        ),
        BackendOption(
            "grammar_max_enum_values",
            "--grammar-max-enum-values",
            positive_int,
            DEFAULT_BOUNDS.max_enum_values,
            "most enum values in one response_format schema, all enums together",
            metavar="N",
        ),
        BackendOption(
            "grammar_max_depth",
            "--grammar-max-depth",
            positive_int,
            DEFAULT_BOUNDS.max_depth,
            "deepest JSON nesting of one response_format schema",
            metavar="LEVELS",
        ),
        BackendOption(
            "grammar_cache_size",
            "--grammar-cache-size",
            positive_int,
            DEFAULT_BOUNDS.cache_size,
            "compiled grammars kept, by schema (least recently used dropped first)",
            metavar="N",
        ),
    ),
    context_length_keyword="context_length",
    cache_dir_keyword="cache_dir",
)
