"""Structured output for the transformers backend: a ``response_format`` as a grammar per row.

A chat line's ``response_format`` (``json_schema`` or ``json_object``) is compiled with xgrammar
against the model's tokenizer, once per distinct schema; every row (choice) of such a line gets its
own ``RowGrammar``, which at each decode step masks the row's logits to the tokens the grammar
allows next, and is told the token that was chosen. When the JSON value is complete, only the
end-of-sequence token is allowed, so the row ends with ``finish_reason`` ``"stop"``; a row cut off
by its output limit first ends with ``"length"`` and its text may be incomplete JSON.

Schemas are compiled strictly (``additionalProperties: false`` where a schema says nothing, as
OpenAI's ``strict: true``) and without free whitespace between tokens, so that a small model cannot
wander into endless spaces. ``json_object`` is any JSON object. A schema xgrammar cannot compile
is that request's ``RequestRejected`` (an ``invalid_request`` error line); other rows go on.
"""

from __future__ import annotations

import json
from typing import Any

from batchgen.core.backends.base import RequestRejected

#: The schema a ``json_object`` response format stands for.
ANY_OBJECT = {"type": "object", "additionalProperties": True}
#: Compiled grammars kept, by schema text (a batch usually repeats one schema).
MAX_COMPILED = 64


class Grammars:
    """Compiles response formats for one tokenizer and hands out a ``RowGrammar`` per row."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        self._xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[str, Any] = {}

    def matcher(self, response_format: dict[str, Any]) -> RowGrammar:
        """A fresh matcher for one row; raises ``RequestRejected`` for a schema that cannot compile."""
        schema = _schema_text(response_format)
        compiled = self._compiled.get(schema)
        if compiled is None:
            try:
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            except Exception as exc:
                raise RequestRejected(
                    "invalid_request",
                    f"'body.response_format' could not be compiled into a grammar: {exc}",
                ) from exc
            if len(self._compiled) >= MAX_COMPILED:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[schema] = compiled
        return RowGrammar(self._xgrammar, compiled, self._vocab_size)


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


def _schema_text(response_format: dict[str, Any]) -> str:
    if response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema") or ANY_OBJECT
    else:
        schema = ANY_OBJECT
    return json.dumps(schema)  # key order kept: properties are generated in the order given
