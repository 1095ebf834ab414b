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
#: The longest stop sequence, in characters: every generated token is checked against each one,
#: so an unbounded one would cost every row of the engine's batch (OpenAI states no limit; real
#: stop sequences are a few characters).
MAX_STOP_CHARS = 1024
#: OpenAI's range of a ``logit_bias`` value, and the most token ids one line may bias.
MAX_LOGIT_BIAS = 100
MAX_LOGIT_BIAS_ENTRIES = 300
#: OpenAI's limit on choices per request (``n``); whether a model gives more than one is its
#: backend's capability (``backends.capabilities``).
MAX_CHOICES = 128
#: Seeds are 64-bit signed integers, as every engine takes them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _stop_string(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_STOP_CHARS


def _token_id(key: object) -> bool:
    return isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18


def _logit_bias(value: object) -> bool:
    return (
        isinstance(value, dict)
        and len(value) <= MAX_LOGIT_BIAS_ENTRIES
        and all(
            _token_id(key) and _number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
            for key, bias in value.items()
        )
    )


@attrs.frozen
class Rule:
    """What a parameter's value must be (``expected`` completes "must be ...") and its test."""

    expected: str
    accepts: Callable[[object], bool]


_PENALTY = Rule("between -2 and 2", lambda v: _number(v) and -2 <= v <= 2)  # type: ignore[operator]
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
        f"a string or a list of at most {MAX_STOP_SEQUENCES} strings, each at most {MAX_STOP_CHARS} characters",
        lambda v: (
            _stop_string(v)
            or (isinstance(v, list) and len(v) <= MAX_STOP_SEQUENCES and all(map(_stop_string, v)))
        ),
    ),
    "n": Rule(
        f"an integer from 1 to {MAX_CHOICES}",
        lambda v: _integer(v) and 1 <= v <= MAX_CHOICES,  # type: ignore[operator]
    ),
    "top_logprobs": Rule("an integer from 0 to 20", lambda v: _integer(v) and 0 <= v <= 20),  # type: ignore[operator]
    "max_output_tokens": _OUTPUT_LIMIT,
    "frequency_penalty": _PENALTY,
    "presence_penalty": _PENALTY,
    "logit_bias": Rule(
        f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids (strings of ASCII digits) to numbers "
        f"from -{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}",
        _logit_bias,
    ),
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
