"""Checks of the arguments of a new batch: completion window, metadata, parameters, output expiry."""

from __future__ import annotations

import re
from typing import Any

from batchgen.core.errors import InvalidRequest
from batchgen.core.models import BatchParameters
from batchgen.core.requests.sampling_ranges import range_problem

_WINDOW = re.compile(r"([1-9][0-9]*)([smhd])", re.ASCII)
_WINDOW_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: The longest completion window a batch may ask for (a year; OpenAI's only window is 24h).
MAX_COMPLETION_WINDOW_S = 365 * 86400
MAX_METADATA_PAIRS = 16
MAX_OUTPUT_EXPIRY_S = 30 * 86400


def parse_completion_window(window: str) -> int:
    """Seconds in a completion window such as ``24h`` (ASCII digits, at most a year); raise
    InvalidRequest otherwise."""
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if match is None:
        raise InvalidRequest(
            f"completion_window must look like '24h' (a number and s, m, h or d), got {_shown(window)}",
            param="completion_window",
        )
    digits = match.group(1)
    # a number too long to be a year in seconds is not converted (int() refuses 4,301 digits)
    seconds = int(digits) * _WINDOW_SECONDS[match.group(2)] if len(digits) <= 12 else None
    if seconds is None or seconds > MAX_COMPLETION_WINDOW_S:
        raise InvalidRequest(
            f"completion_window may be at most {MAX_COMPLETION_WINDOW_S // 86400}d "
            f"({MAX_COMPLETION_WINDOW_S} seconds), got {_shown(window)}",
            param="completion_window",
        )
    return seconds


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """A copy of valid batch metadata (at most 16 short string pairs); InvalidRequest otherwise."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of string keys and values", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata may have at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > 64:
            raise InvalidRequest(
                "metadata keys must be at most 64 characters and values strings of at most 512",
                param="metadata",
            )
        if not isinstance(value, str) or len(value) > 512:
            raise InvalidRequest(
                f"metadata.{key} must be a string of at most 512 characters "
                "(metadata keys must be at most 64 characters and values strings of at most 512)",
                param=f"metadata.{key}",
            )
    return dict(metadata)


def check_parameters(parameters: BatchParameters) -> None:
    """Raise InvalidRequest naming the first batch-level sampling value out of its range (the
    rules of ``sampling_ranges``, which every request line's body is checked with too)."""
    for name, value in parameters.to_dict().items():
        problem = range_problem(name, value)
        if problem is not None:
            raise InvalidRequest(f"{name} {problem}", param=name)


def check_output_expiry(seconds: Any) -> None:
    """``output_expires_after`` seconds must be a whole number from 1 to 30 days."""
    if seconds is None:
        return
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= MAX_OUTPUT_EXPIRY_S:
        raise InvalidRequest(
            f"output_expires_after seconds must be a whole number from 1 to {MAX_OUTPUT_EXPIRY_S}, got {seconds!r}",
            param="output_expires_after",
        )
