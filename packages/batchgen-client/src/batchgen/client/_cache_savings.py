"""What the server's result cache saved a batch, read from the batch object's `usage`.

A BatchGen server whose result cache serves the batch's tenant reports, in `usage`, the requests
it answered from the cache (`cached_requests`), the prompt tokens of those answers and all their
tokens, which were not computed again (`saved_tokens`). The prompt tokens are
`input_tokens_details.cached_tokens` less `prefix_cached_tokens`, since OpenAI's field also counts
the prompt tokens the engines' prefix caches served. A server without the cache, or another
Batch API, reports none: then `cache_savings` is None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchgen.client._wording import count_of

__all__ = ["CacheSavings", "cache_savings", "format_cache_savings"]


@dataclass(frozen=True, slots=True)
class CacheSavings:
    """Requests answered from the result cache, their prompt tokens, and all the tokens saved."""

    requests: int
    prompt_tokens: int
    saved_tokens: int


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def cache_savings(batch: Mapping[str, Any]) -> CacheSavings | None:
    """The batch's cache savings, or None when its server reports none (or malformed ones)."""
    usage = batch.get("usage")
    if not isinstance(usage, Mapping):
        return None
    requests, saved = _count(usage.get("cached_requests")), _count(usage.get("saved_tokens"))
    if requests is None or saved is None:
        return None
    details = usage.get("input_tokens_details")
    prompt = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    prefix = _count(usage.get("prefix_cached_tokens")) or 0  # the engines' share of cached_tokens
    return CacheSavings(requests, max(0, (prompt or 0) - prefix), saved)


def format_cache_savings(batch: Mapping[str, Any]) -> str | None:
    """`1,000 requests answered from the result cache (31,316 tokens not computed again)`, or None
    when the cache answered none of the batch's requests."""
    savings = cache_savings(batch)
    if savings is None or savings.requests == 0:
        return None
    return (
        f"{count_of(savings.requests, 'request')} answered from the result cache "
        f"({count_of(savings.saved_tokens, 'token')} not computed again)"
    )
