"""A child process of the transformers worker that tries a schema's grammar compile under a deadline.

A grammar compile cannot be interrupted once it runs (it is C++ inside xgrammar), so a schema is
first compiled here, in a process of its own that is killed at the deadline: a compile that takes
too long, eats all memory or crashes ends this process, never the worker. Only a schema whose
compile finished here in time is compiled again in the worker (on a thread: xgrammar releases the
GIL while it compiles, so the decode loop keeps stepping), because a compiled grammar is far too
big to send back (hundreds of MB of JSON for a large schema).

The worker starts it as ``python -m batchgen.core.backends.hf_grammar_probe --fd N`` and talks
over the pipe with pickled tuples:

    worker -> probe   ("tokenizer", info_json)   first: the tokenizer the grammars are for
                      ("probe", schema_text)     compile this schema
    probe -> worker   ("ready",)                 the tokenizer is loaded
                      ("ok",)                    it compiled, and some token can start a value
                      ("error", message)         it cannot compile, or no value satisfies it

The probe exits when its pipe closes, and when its parent process is gone (checked every half
second on a thread, so it also ends while a compile runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

#: How long a probe may take to start (import xgrammar, load the tokenizer) before it counts as failed.
START_TIMEOUT_S = 120.0


class ProbeFailed(Exception):
    """The probe could not answer: it did not start, or it died."""


class CompileTimedOut(Exception):
    """The compile did not finish by its deadline (the probe process was killed)."""


class GrammarProbe:
    """The worker's side of one probe process, started on first use and after each kill."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        #: How many probe processes were started (a compile past its deadline kills one).
        self.starts = 0

    def probe(self, schema_text: str, timeout_s: float) -> str | None:
        """None when the schema compiled within ``timeout_s``; else why not, as one sentence.

        Raises ``CompileTimedOut`` when the deadline passed (the process is killed) and ``ProbeFailed``
        when the process could not start or died meanwhile."""
        connection = self._ensure_started()
        try:
            connection.send(("probe", schema_text))
            answered = connection.poll(timeout_s)
            message = connection.recv() if answered else None
        except (EOFError, OSError) as exc:
            process = self._process
            self.close()  # reaps it: its status is known
            status = None if process is None else process.returncode
            raise ProbeFailed(f"the grammar compiler process ended (status {status})") from exc
        if message is None:
            self.close()
            raise CompileTimedOut(f"the compile took longer than {timeout_s:g} s")
        return None if message[0] == "ok" else str(message[1])

    def _ensure_started(self) -> Connection:
        if self._connection is not None and self._process is not None and self._process.poll() is None:
            return self._connection
        self.close()
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "batchgen.core.backends.hf_grammar_probe",
                    "--fd",
                    str(theirs.fileno()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.starts += 1
        self._connection = Connection(ours.detach())
        try:
            self._connection.send(("tokenizer", self._info))
            if not self._connection.poll(START_TIMEOUT_S):
                raise ProbeFailed(f"the grammar compiler process did not start within {START_TIMEOUT_S:g} s")
            self._connection.recv()
        except (EOFError, OSError) as exc:
            self.close()
            raise ProbeFailed("the grammar compiler process could not start") from exc
        except ProbeFailed:
            self.close()
            raise
        return self._connection

    def close(self) -> None:
        """Kill the process (if any) and forget it; the next probe starts a new one."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
            process.wait()
        if connection is not None:
            connection.close()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def _answer(
    compiler: Any, xgrammar: Any, stop_ids: set[int], vocab_size: int, schema: str
) -> tuple[Any, ...]:
    try:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
    except Exception as exc:
        return ("error", f"could not be compiled into a grammar: {exc}".strip())
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    words = [word & 0xFFFFFFFF for word in bitmask[0].tolist()]  # int32 words, one bit per token
    for token in stop_ids:
        if 0 <= token < vocab_size:
            words[token // 32] &= ~(1 << (token % 32))
    if not any(words):
        return ("error", "can never be satisfied: no JSON value matches it")
    return ("ok",)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf_grammar_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    connection = Connection(args.fd)
    try:
        import xgrammar

        _, info_json = connection.recv()
        info = xgrammar.TokenizerInfo.deserialize_json(info_json)
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        stop_ids = set(info.stop_token_ids)
        connection.send(("ready",))
        while True:
            _, schema = connection.recv()
            connection.send(_answer(compiler, xgrammar, stop_ids, info.vocab_size, schema))
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
