"""Sampling-parameter resolution: per-request body, then batch level, then server default.

The output limit is the body's ``max_completion_tokens``, else its ``max_tokens``, else the batch's
``max_decoding_length``, else the server default. Sampling with nothing set is greedy. A body that
sets no sampling field (``sets_sampling`` is False) resolves to the batch level alone, so callers
may resolve such bodies once per batch.
"""

from __future__ import annotations

from typing import Any

import attrs

from batchgen.core.models import BatchParameters, SamplingParameters
from batchgen.core.requests.schema import RequestBody


@attrs.frozen
class ServerDefaults:
    """The lowest priority level: what the server uses when neither body nor batch says."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


def resolve_sampling(
    body: RequestBody, batch: BatchParameters, defaults: ServerDefaults
) -> SamplingParameters:
    """Combine the three levels into one request's parameters.

    ``body`` comes from ``requests.schema.read_body``, which checked its types and ranges (and
    ``check_parameters`` the batch's), so nothing here can be malformed.
    """
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    stop = body.stop
    return SamplingParameters(
        max_tokens=_or(max_tokens, batch.max_decoding_length, defaults.max_tokens),
        temperature=float(_or(body.temperature, batch.temperature, defaults.temperature)),
        top_p=float(_or(body.top_p, batch.top_p, defaults.top_p)),
        top_k=_or(body.top_k, batch.top_k, defaults.top_k),
        seed=body.seed,
        stop=() if stop is None else (stop,) if isinstance(stop, str) else tuple(stop),
    )


def sets_sampling(body: RequestBody) -> bool:
    """Whether the body sets any field ``resolve_sampling`` reads (if not, every such body of one
    batch resolves to the same parameters)."""
    return not (
        body.max_tokens is None
        and body.max_completion_tokens is None
        and body.temperature is None
        and body.top_p is None
        and body.top_k is None
        and body.seed is None
        and body.stop is None
    )


def _or(body_value: Any, batch_value: Any, default: Any) -> Any:
    """The first level that sets a value: body, then batch, then server."""
    if body_value is not None:
        return body_value
    return batch_value if batch_value is not None else default
