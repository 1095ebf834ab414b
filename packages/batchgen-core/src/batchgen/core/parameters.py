"""Sampling-parameter resolution: per-request body, then batch level, then server default.

The output limit is the body's ``max_completion_tokens``, else its ``max_tokens``, else the batch's
``max_decoding_length``, else the server default. Sampling with nothing set is greedy.
"""

from __future__ import annotations

from typing import Any

import attrs

from batchgen.core.errors import InvalidRequest
from batchgen.core.models import BatchParameters, SamplingParameters


@attrs.frozen
class ServerDefaults:
    """The lowest priority level: what the server uses when neither body nor batch says."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{key}' must be a number", param=key)
    return float(value)


def _integer(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{key}' must be an integer", param=key)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")


def resolve_sampling(
    body: dict[str, Any], batch: BatchParameters, defaults: ServerDefaults
) -> SamplingParameters:
    """Combine the three levels into one request's parameters; raise InvalidRequest if malformed."""
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = (
            batch.max_decoding_length if batch.max_decoding_length is not None else defaults.max_tokens
        )
    if max_tokens < 1:
        raise InvalidRequest("the output token limit must be at least 1", param="max_tokens")
    temperature = _number(body, "temperature")
    top_p = _number(body, "top_p")
    top_k = _integer(body, "top_k")
    return SamplingParameters(
        max_tokens=max_tokens,
        temperature=_or(temperature, batch.temperature, defaults.temperature),
        top_p=_or(top_p, batch.top_p, defaults.top_p),
        top_k=_or(top_k, batch.top_k, defaults.top_k),
        seed=_integer(body, "seed"),
        stop=_stop(body),
    )


def _or(body_value: Any, batch_value: Any, default: Any) -> Any:
    """The first level that sets a value: body, then batch, then server."""
    if body_value is not None:
        return body_value
    return batch_value if batch_value is not None else default
