"""Validating an upload's parts, as they arrive, in a process of its own.

Validation costs more CPU than receiving the bytes, and in the server's process it would share
one interpreter lock with the receiving. So while a ``batch`` upload's parts arrive, a worker
process (``ValidationWorker``: a fresh Python running ``main`` here, which imports the core and
nothing of the server, talking over a socket pair) validates them in the order they arrived (``StreamedValidation``,
then, if it asks for one, the exact pass over the same parts): on a machine with two cores the
validation of part k runs while part k+1 is received. The worker gets a picklable copy of what
validation needs of the served models (``line_router_copy``: each model's names, backend name and
capabilities, no backend). It sends back the summary, or the problems with their line numbers
(``InvalidBatchFile`` rebuilt here); a worker that dies or cannot start gives None, and the caller
validates itself. A worker whose server died (even by ``kill -9``) exits within
``ORPHAN_CHECK_S``: it watches its parent, not only the socket, which it reads only between parts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Collection
from multiprocessing.connection import Connection
from typing import Any

import attrs

from batchgen.core.backends.served_models import ModelSet, ServedModel
from batchgen.core.errors import InvalidBatchFile, LineProblem
from batchgen.core.files.batch_file import BatchFileSummary, LineRouter
from batchgen.core.files.streamed_validation import (
    BomStrip,
    Segment,
    StreamedValidation,
    segment_chunks,
    validate_exactly,
)

#: Worker processes validating at once; an upload that finds them all busy is validated at complete.
MAX_WORKERS = 2
_workers = threading.BoundedSemaphore(MAX_WORKERS)
#: How often a worker checks that the server that started it is still its parent.
ORPHAN_CHECK_S = 0.2
#: What the worker process runs (``python -c``: ``-m`` would import this module twice). First,
#: with nothing but the standard library (importing the core takes seconds on a loaded machine),
#: a thread that ends the worker once the server (``argv[2]``) is no longer its parent: the
#: server died, and the socket's end of file is only read between parts, each of which may take
#: long to validate.
_WORKER_MAIN = f"""
import os, sys, threading, time
def _exit_when_orphaned(parent=int(sys.argv[2])):
    while os.getppid() == parent:
        time.sleep({ORPHAN_CHECK_S!r})
    os._exit(0)
threading.Thread(target=_exit_when_orphaned, daemon=True).start()
from batchgen.core.files.upload_validation_worker import main
main()
"""


@attrs.frozen
class _BackendCopy:
    """What validation reads of a backend: its names and capabilities."""

    name: str
    model_name: str | None
    model_names: tuple[str, ...]
    capabilities: Any


def line_router_copy(served: ModelSet) -> ModelSet:
    """``served`` as the worker needs it: a ``ModelSet`` of models whose backends are copies."""
    models = []
    for model in served:
        backend = model.backend
        names = getattr(backend, "model_names", ())
        copy = _BackendCopy(
            name=getattr(backend, "name", "?"),
            model_name=getattr(backend, "model_name", None),
            model_names=tuple(name for name in names if isinstance(name, str)),
            capabilities=model.capabilities,
        )
        models.append(ServedModel(copy, name=model.public_name, aliases=model.aliases))  # type: ignore[arg-type]
    return ModelSet(models)


def _validate(connection: Connection, served: Collection[str] | LineRouter | None) -> None:
    """The worker: validate the parts (segments of files) named on ``connection`` in order until
    told to finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops this
    validation = StreamedValidation(served)
    segments: list[Segment] = []
    bom = BomStrip()
    try:
        while True:
            kind, value = connection.recv()
            if kind == "part":
                segment = Segment(*value)
                for chunk in segment_chunks([segment], forget=True):
                    validation.feed(bom.feed(chunk))
                segments.append(segment)
                continue
            validation.feed(bom.finish())
            found = validation.finish()
            try:
                if not isinstance(found, BatchFileSummary):
                    found = validate_exactly(segment_chunks(segments, skip=bom.skipped), served, found)
                connection.send(("valid", found.line_count, found.url))
            except InvalidBatchFile as exc:
                problems = [(problem.line, problem.message, problem.left_out) for problem in exc.problems]
                connection.send(("invalid", problems, exc.total_problems))
            return
    except (EOFError, OSError):  # the server went away, or a part was deleted (cancelled)
        return
    finally:
        connection.close()


class ValidationWorker:
    """One upload's worker process; ``push`` each part as it arrives, then ``result``."""

    def __init__(self, served: Collection[str] | LineRouter | None) -> None:
        self.order: list[str] = []
        self._connection: Connection | None = None
        self._process: Any = None
        if isinstance(served, LineRouter) and not isinstance(served, ModelSet):
            return  # a router this module cannot copy: the upload is validated in the server
        if not _workers.acquire(blocking=False):
            return
        try:
            copy = line_router_copy(served) if isinstance(served, ModelSet) else served
            ours, theirs = socket.socketpair()
            with theirs:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno()), str(os.getpid())],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                )
            self._connection = Connection(ours.detach())
            self._connection.send(copy)
        except Exception:  # no worker: the upload is validated at complete
            if self._process is not None:
                self._process.kill()
            self._connection = None
            self._process = None
            _workers.release()

    @property
    def running(self) -> bool:
        return self._connection is not None

    def push(self, part_id: str, segment: Segment) -> None:
        self.order.append(part_id)
        if self._connection is not None:
            try:
                self._connection.send(("part", tuple(segment)))
            except OSError:
                self.close()

    def result(self) -> BatchFileSummary | None:
        """The summary (InvalidBatchFile for a file with problems); None if the worker failed."""
        connection = self._connection
        if connection is None:
            return None
        try:
            connection.send(("finish", None))
            answer = connection.recv()
        except (EOFError, OSError):
            return None
        finally:
            self.close()
        if answer[0] == "valid":
            return BatchFileSummary(line_count=answer[1], url=answer[2])
        raise InvalidBatchFile([LineProblem(*problem) for problem in answer[1]], answer[2])

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.close()
        process, self._process = self._process, None
        with contextlib.suppress(Exception):
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        _workers.release()


def main() -> None:
    """The worker process (``_WORKER_MAIN FD PARENT``, where FD is its end of a socket pair and
    PARENT the server's process id); the first message is the served models."""
    connection = Connection(int(sys.argv[1]))
    try:
        served = connection.recv()
    except (EOFError, OSError):
        return
    _validate(connection, served)
