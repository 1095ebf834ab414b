"""Parsers for ``BackendOption.type``: one command-line string in, one checked value out.

Each raises ValueError with a message fit for the command line (``batchgen-server`` shows it
after the flag's name). Plain ``str``, ``int`` and ``float`` serve as types too.
"""

from __future__ import annotations

import json


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A number of at least 0 (seconds, say)."""
    value = float(text)
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(f"must be between 0 and 1, got {value}")
    return value


def key_value(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` as ``(key, value)``: dashes in the key become underscores, and a value that
    reads as JSON (``8192``, ``true``, ``[1, 2]``) is decoded; any other value stays a string."""
    key, separator, raw = text.partition("=")
    if not separator or not key:
        raise ValueError("expected KEY=VALUE")
    try:
        value: object = json.loads(raw)
    except ValueError:
        value = raw
    return key.replace("-", "_"), value
