"""How the client's messages word a count: `1 retry`, `2 retries`, `0 bytes`."""

from __future__ import annotations

__all__ = ["count_of"]


def count_of(count: int, singular: str, plural: str | None = None) -> str:
    """`count` and the noun that goes with it: `count_of(1, "retry", "retries")` is `1 retry`,
    `count_of(2, "request")` is `2 requests` (`plural` defaults to `singular + "s"`); thousands are
    separated by commas."""
    noun = singular if count == 1 else (plural if plural is not None else singular + "s")
    return f"{count:,} {noun}"
