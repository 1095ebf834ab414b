"""The allowed values of each sampling parameter: one rule set for the batch level and every line.

``POST /v1/batches`` checks its batch-level defaults (``max_decoding_length``, ``temperature``,
``top_p``, ``top_k``) with these rules, and the request schema checks the same parameters in each
line's body with them, so a value refused for a batch is refused in a line and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

#: OpenAI's limit on stop sequences per request.
MAX_STOP_SEQUENCES = 4
#: OpenAI's limit on choices per request (``n``); whether a model gives more than one is its
#: backend's capability (``backends.capabilities``).
MAX_CHOICES = 128
#: Seeds are 64-bit signed integers, as every engine takes them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@attrs.frozen
class Rule:
    """What a parameter's value must be (``expected`` completes "must be ...") and its test."""

    expected: str
    accepts: Callable[[object], bool]


_OUTPUT_LIMIT = Rule("at least 1", lambda v: _integer(v) and v >= 1)  # type: ignore[operator]

#: Every sampling parameter a batch or a line may set, by the name it has there.
RULES: dict[str, Rule] = {
    "max_decoding_length": _OUTPUT_LIMIT,
    "max_tokens": _OUTPUT_LIMIT,
    "max_completion_tokens": _OUTPUT_LIMIT,
    "temperature": Rule("between 0 and 2", lambda v: _number(v) and 0 <= v <= 2),  # type: ignore[operator]
    "top_p": Rule("in (0, 1]", lambda v: _number(v) and 0 < v <= 1),  # type: ignore[operator]
    "top_k": Rule("-1 or at least 1", lambda v: _integer(v) and (v == -1 or v >= 1)),  # type: ignore[operator]
    "seed": Rule("a 64-bit signed integer", lambda v: _integer(v) and INT64_MIN <= v <= INT64_MAX),  # type: ignore[operator]
    "stop": Rule(
        f"a string or a list of at most {MAX_STOP_SEQUENCES} strings",
        lambda v: (
            isinstance(v, str)
            or (
                isinstance(v, list)
                and len(v) <= MAX_STOP_SEQUENCES
                and all(isinstance(item, str) for item in v)
            )
        ),
    ),
    "n": Rule(
        f"an integer from 1 to {MAX_CHOICES}",
        lambda v: _integer(v) and 1 <= v <= MAX_CHOICES,  # type: ignore[operator]
    ),
    "top_logprobs": Rule("an integer from 0 to 20", lambda v: _integer(v) and 0 <= v <= 20),  # type: ignore[operator]
    "max_output_tokens": _OUTPUT_LIMIT,
}


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def range_problem(name: str, value: object) -> str | None:
    """``"must be ..., got ..."`` when ``value`` breaks the rule for parameter ``name``; None when
    it is absent (None) or allowed."""
    if value is None:
        return None
    rule = RULES[name]
    return None if rule.accepts(value) else f"must be {rule.expected}, got {_shown(value)}"
