"""Structured output for the transformers backend: a ``response_format`` as a grammar per row.

A chat line's ``response_format`` (``json_schema`` or ``json_object``) is compiled with xgrammar
against the model's tokenizer, once per distinct schema; every row (choice) of such a line gets its
own ``RowGrammar``, which at each decode step masks the row's logits to the tokens the grammar
allows next, and is told the token that was chosen. When the JSON value is complete, only the
end-of-sequence token is allowed, so the row ends with ``finish_reason`` ``"stop"``; a row cut off
by its output limit first ends with ``"length"`` and its text may be incomplete JSON.

Schemas are compiled strictly (``additionalProperties: false`` where a schema says nothing, as
OpenAI's ``strict: true``) and without free whitespace between tokens, so that a small model cannot
wander into endless spaces. ``json_object`` is any JSON object.

No compile runs on the decode loop. ``Grammars.request`` checks a schema against its bounds
(``hf_grammar_bounds``: size first, then the keywords the compiler would ignore) and hands back a
``Future``; a thread of the worker compiles, one schema at a time: first in the probe process
(``hf_grammar_probe``), which is killed at ``compile_timeout_s``, then, for a schema that compiled
there in time, in the worker itself (xgrammar releases the GIL while compiling, so decoding goes on).
A schema past a bound, one that does not compile in time, does not compile, or that no value can
satisfy, is that line's ``RequestRejected`` (an ``invalid_request`` error line); other rows go on.
Outcomes, failures included, are kept in an LRU of ``cache_size`` schemas by canonical schema text,
so a batch that repeats one schema compiles it once.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

from batchgen.core.backends.base import RequestRejected
from batchgen.core.backends.hf_grammar_bounds import GrammarBounds, checked_schema_text
from batchgen.core.backends.hf_grammar_probe import CompileTimedOut, GrammarProbe, ProbeFailed

logger = logging.getLogger("batchgen.backends.transformers")


def _rejected(message: str) -> RequestRejected:
    return RequestRejected("invalid_request", f"'body.response_format.json_schema' {message}")


class Grammars:
    """Compiles response formats for one tokenizer off the decode loop (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        bounds: GrammarBounds | None = None,
    ) -> None:
        import xgrammar

        self._xgrammar = xgrammar
        self.bounds = bounds or GrammarBounds()
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._probe = GrammarProbe(info.serialize_json())
        self._lock = threading.Lock()
        #: Finished compiles by schema text: a compiled grammar, or the line's rejection.
        self._done: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._compiling: dict[str, Future[Any]] = {}
        self._jobs: queue.Queue[tuple[str, Future[Any]] | None] = queue.Queue()
        self._settled = threading.Condition(self._lock)
        #: How many schemas were compiled in the worker (a cache hit compiles nothing).
        self.compiles = 0
        self._thread = threading.Thread(target=self._compile_forever, name="batchgen-grammar", daemon=True)
        self._thread.start()

    def request(self, response_format: dict[str, Any]) -> Future[Any]:
        """The compiled grammar for a line, as a future; raises ``RequestRejected`` at once for a
        schema past a bound. The future's exception is the line's ``RequestRejected``."""
        text = checked_schema_text(response_format, self.bounds)
        with self._lock:
            if text in self._done:
                self._done.move_to_end(text)
                return _settled(self._done[text])
            future = self._compiling.get(text)
            if future is None:
                future = self._compiling[text] = Future()
                self._jobs.put((text, future))
            return future

    def matcher(self, compiled: Any) -> RowGrammar:
        """A fresh matcher for one row of a compiled grammar."""
        return RowGrammar(self._xgrammar, compiled, self._vocab_size)

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for any compile to finish (the decode loop, when it has only
        lines waiting for their grammars)."""
        with self._settled:
            if self._compiling:
                self._settled.wait(timeout_s)

    def close(self) -> None:
        """Stop the compile thread after its current schema and kill the probe process."""
        self._jobs.put(None)
        self._probe.close()

    # --- the compile thread ---------------------------------------------------------------
    def _compile_forever(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            text, future = job
            keep = True
            try:
                outcome: Any = self._compile(text)
            except ProbeFailed as exc:  # the probe could not run: not the schema's fault, not kept
                outcome, keep = _rejected(f"could not be compiled into a grammar: {exc}"), False
            except Exception as exc:  # never let the thread die: the line fails, others go on
                logger.exception("a grammar compile failed")
                outcome = _rejected(f"could not be compiled into a grammar: {type(exc).__name__}: {exc}")
            with self._settled:
                if keep:
                    self._done[text] = outcome
                while len(self._done) > max(self.bounds.cache_size, 0):
                    self._done.popitem(last=False)
                del self._compiling[text]
                _settle(future, outcome)
                self._settled.notify_all()

    def _compile(self, text: str) -> Any:
        timeout_s = self.bounds.compile_timeout_s
        try:
            problem = self._probe.probe(text, timeout_s)
        except CompileTimedOut:
            return _rejected(
                f"took longer than {timeout_s:g} s to compile into a grammar (--grammar-compile-timeout); "
                "make the schema smaller or simpler"
            )
        if problem is not None:
            return _rejected(problem)
        self.compiles += 1
        return self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)


def _settled(outcome: Any) -> Future[Any]:
    future: Future[Any] = Future()
    _settle(future, outcome)
    return future


def _settle(future: Future[Any], outcome: Any) -> None:
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class RowGrammar:
    """One row's place in its grammar: masks its logits, follows its tokens."""

    def __init__(self, xgrammar: Any, compiled: Any, vocab_size: int) -> None:
        self._xgrammar = xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    @property
    def finished(self) -> bool:
        """Whether the value is complete and its end accepted."""
        return bool(self._matcher.is_terminated())

    def mask(self, logits: Any) -> None:
        """Set every token the grammar does not allow next to -inf, in place (one row's logits)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgrammar.apply_token_bitmask_inplace(logits[None], self._bitmask.to(logits.device))

    def accept(self, token: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.accept_token(token)
