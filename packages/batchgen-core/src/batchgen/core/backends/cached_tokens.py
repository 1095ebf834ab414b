"""The prompt tokens an engine's prefix cache served, read from what the engine answered.

Engines report it per request: vLLM and SGLang as ``cached_tokens``, an OpenAI-compatible server
as ``usage.prompt_tokens_details.cached_tokens``. ``bounded_cached_tokens`` is the one check every
backend applies where it parses the figure: an int (not a bool) within 0 and the request's prompt
tokens is kept; anything else (absent, null, a string, a float, negative, more than the prompt)
is None, "the engine does not say", so no malformed answer reaches a line or a counter.
"""

from __future__ import annotations

from typing import Any


def bounded_cached_tokens(value: object, prompt_tokens: int) -> int | None:
    """``value`` if it is an int within 0..``prompt_tokens``, else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= prompt_tokens else None


def upstream_cached_tokens(usage: Any, prompt_tokens: int) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI-shaped answer, bounded (None
    when ``usage`` or its details are missing or not objects)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict):
        return None
    return bounded_cached_tokens(details.get("cached_tokens"), prompt_tokens)
