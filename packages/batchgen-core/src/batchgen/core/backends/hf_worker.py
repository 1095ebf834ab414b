"""The transformers worker process: a ``DecodeEngine`` fed through a pipe, apart from the HTTP side.

The server starts it as ``python -m batchgen.core.backends.hf_worker --fd N`` (``WorkerProcess``),
with one end of a socket pair as file descriptor N, and talks to it with pickled tuples:

    server -> worker   ("submit", GenerationRequest)   queue a request
                       ("abort", request_id)           end it at the next step
                       ("stop",)                       finish: end everything and exit
    worker -> server   ("ready", EngineInfo)           the model is loaded; requests may come
                       ("failed", message)             the model could not be loaded; it exits
                       ("done", [Outcome, ...])        requests that ended in one step
                       ("heartbeat", busy_s,           alive (every HEARTBEAT_S, busy or not), and
                        running, tokens)               how long the model loop has been in its
                                                       current turn (0 while it waits for work); the
                                                       requests in its running batch and the tokens
                                                       it has generated so far, as of its last step

The model loop runs on the worker's main thread; a reader thread moves messages into a queue that
the loop drains between steps, and a heartbeat thread says it is alive and how long the loop's
current turn has lasted, so that a loop stuck in one step shows as unhealthy. Grammars for
structured output are compiled off the loop (``hf_grammar``). When the server's end of
the pipe closes (the server stopped or died, even by SIGKILL), the worker exits at its next step,
so no worker outlives its server.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs

from batchgen.core.backends.hf_decode import DecodeEngine
from batchgen.core.backends.hf_grammar_bounds import DEFAULT_BOUNDS, GrammarBounds
from batchgen.core.backends.hf_model_files import ModelNotFound

logger = logging.getLogger("batchgen.backends.transformers")

#: Seconds between two heartbeats of a worker.
HEARTBEAT_S = 1.0
#: How long an idle worker waits for more requests after the first, to start with a fuller batch.
GATHER_S = 0.005


@attrs.frozen
class WorkerOptions:
    """What the worker builds its engine from (the backend's options)."""

    model: str | None
    cache_dir: str
    device: str | None
    dtype: str
    max_batch_size: int
    context_length: int | None
    threads: int | None = None
    grammar_compile_timeout_s: float = DEFAULT_BOUNDS.compile_timeout_s
    grammar_max_schema_bytes: int = DEFAULT_BOUNDS.max_schema_bytes
    grammar_max_properties: int = DEFAULT_BOUNDS.max_properties
    grammar_max_enum_values: int = DEFAULT_BOUNDS.max_enum_values
    grammar_max_depth: int = DEFAULT_BOUNDS.max_depth
    grammar_cache_size: int = DEFAULT_BOUNDS.cache_size

    @property
    def grammar_bounds(self) -> GrammarBounds:
        return GrammarBounds(
            max_schema_bytes=self.grammar_max_schema_bytes,
            max_properties=self.grammar_max_properties,
            max_enum_values=self.grammar_max_enum_values,
            max_depth=self.grammar_max_depth,
            compile_timeout_s=self.grammar_compile_timeout_s,
            cache_size=self.grammar_cache_size,
        )

    def command(self, fd: int) -> list[str]:
        """The worker's command line, handing it the pipe as ``fd``."""
        command = [sys.executable, "-m", "batchgen.core.backends.hf_worker", "--fd", str(fd)]
        for name, value in attrs.asdict(self).items():
            if value is not None:
                command += [f"--{name.replace('_', '-')}", str(value)]
        return command


def _parse(argv: list[str]) -> tuple[int, WorkerOptions]:
    parser = argparse.ArgumentParser(prog="hf_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--model")
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch-size", type=int, required=True)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--grammar-compile-timeout-s", type=float, default=DEFAULT_BOUNDS.compile_timeout_s)
    for name in ("max_schema_bytes", "max_properties", "max_enum_values", "max_depth", "cache_size"):
        flag = "--grammar-" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(DEFAULT_BOUNDS, name))
    args = vars(parser.parse_args(argv))
    fd = args.pop("fd")
    return fd, WorkerOptions(**args)


class _Link:
    """The worker's end of the pipe: a reader thread filling ``inbox``, and locked sends."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._send_lock = threading.Lock()
        self.closed = threading.Event()
        #: When the model loop's current turn began (None while it waits for work).
        self.turn_began: float | None = None
        #: As of the loop's last step: requests in the running batch, tokens generated so far.
        self.running = 0
        self.tokens = 0

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self.connection.send(message)
            except OSError:  # the server is gone; the loop notices through the inbox
                self.closed.set()

    def read_forever(self) -> None:
        try:
            while True:
                self.inbox.put(self.connection.recv())
        except (EOFError, OSError):
            self.closed.set()
            self.inbox.put(("stop",))

    def beat_forever(self) -> None:
        while not self.closed.wait(HEARTBEAT_S):
            began = self.turn_began
            busy_s = 0.0 if began is None else time.monotonic() - began
            self.send(("heartbeat", busy_s, self.running, self.tokens))


def serve(
    connection: Connection, options: WorkerOptions, on_loaded: Callable[[], object] | None = None
) -> None:
    """Load the engine, then run requests from ``connection`` until told to stop or the pipe closes
    (``on_loaded`` is called once the model is loaded, before the worker says it is ready)."""
    link = _Link(connection)
    threading.Thread(target=link.read_forever, name="batchgen-worker-reader", daemon=True).start()
    threading.Thread(target=link.beat_forever, name="batchgen-worker-heartbeat", daemon=True).start()
    if options.threads:
        import torch

        torch.set_num_threads(options.threads)
    engine = DecodeEngine(
        model=options.model,
        cache_dir=Path(options.cache_dir),
        device=options.device,
        dtype=options.dtype,
        max_batch_size=options.max_batch_size,
        context_length=options.context_length,
        grammar_bounds=options.grammar_bounds,
    )
    try:
        info = engine.load()
    except Exception as exc:
        if not isinstance(exc, ModelNotFound):  # a wrong --model: the reason sent back says it all
            logger.exception("the transformers worker could not load its model")
        link.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    if on_loaded is not None:
        on_loaded()
    link.send(("ready", info))
    while True:
        link.turn_began = time.monotonic()
        if not _take_messages(link, engine):
            link.send(("done", engine.fail_all("the transformers worker stopped")))
            engine.close()
            return
        try:
            finished = engine.step()
        except Exception as exc:  # e.g. out of memory: this attempt failed; the service retries
            logger.exception("a decode step failed")
            finished = engine.fail_all(f"generate failed: {exc!r}")
        link.running, link.tokens = engine.running_requests, engine.tokens_generated
        if finished:
            link.send(("done", finished))


def _take_messages(link: _Link, engine: DecodeEngine) -> bool:
    """Apply every waiting message (waiting for one when idle); False once told to stop."""
    idle = not engine.busy
    while True:
        try:
            if idle:
                link.turn_began = None  # waiting for work is no stall
                message = link.inbox.get()
                link.turn_began = time.monotonic()
            else:
                message = link.inbox.get_nowait()
        except queue.Empty:
            return True
        kind = message[0]
        if kind == "stop":
            return False
        if kind == "submit":
            engine.add(message[1])
            if idle:  # the first request after a pause: give its companions a moment to arrive
                idle = False
                time.sleep(GATHER_S)
        elif kind == "abort":
            engine.abort(message[1])


def _leave_stop_signals_to_the_server() -> None:
    """Once the model is loaded, the server decides when this process ends (a "stop" message, or a
    kill): a Ctrl-C or a SIGTERM sent to the whole process group (a terminal, systemd) is the
    server's to act on. Had the worker died of it, the server would have taken that for a crash and
    started a new worker while stopping. During the load the signal still ends a start that was
    asked to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> None:
    fd, options = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    connection = Connection(fd)
    try:
        serve(connection, options, on_loaded=_leave_stop_signals_to_the_server)
    finally:
        connection.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # do not wait for the reader thread blocked in recv


if __name__ == "__main__":
    main()
