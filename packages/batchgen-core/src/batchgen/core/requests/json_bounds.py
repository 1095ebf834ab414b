"""Bounds on the shape of untrusted JSON, checked on its bytes before anything decodes it.

A document nested deeper than ``MAX_DEPTH`` (arrays and objects) or holding an integer outside
the 64-bit signed range is refused. Decoders recurse once per level, and the event loop decodes a
request line again, with less stack to spare, when the request runs; big integers overflow SQLite
and the engines. Checking the bytes first makes every later decode of an accepted document safe.

Both checks start with a scan in C (counting brackets, looking for 19 digits in a row), so an
ordinary line costs a few microseconds; only a line that might break a bound is looked at closely.
``lines_within_bounds`` makes the same first look at a block of many lines at once.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
MIN_INTEGER, MAX_INTEGER = -(2**63), 2**63 - 1

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: One pass for both first looks: every digit becomes "0", "[" and "{" become "(", the rest " ".
_CLASSES = bytes(0x30 if byte in b"0123456789" else 0x28 if byte in b"[{" else 0x20 for byte in range(256))
_NINETEEN_DIGITS = b"0" * 19
#: An integer token of 19 digits or more (not a fraction's or an exponent's digits).
_LONG_INTEGER = re.compile(rb"(?<![0-9.eE+-])-?[0-9]{19,}(?![0-9.eE])")
#: Kept of a block: its opening brackets (as "(") and newlines; a line with more than MAX_DEPTH
#: openings is then a run of that many "(".
_OPENINGS = bytes.maketrans(b"[{", b"((")
_NOT_OPENINGS = bytes(set(range(256)) - set(b"[{\n"))
_TOO_MANY_OPENINGS = b"(" * (MAX_DEPTH + 1)
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def _depth_exceeds(outside_strings: bytes, limit: int) -> bool:
    """Whether the brackets nest deeper than ``limit`` (each pass removes the innermost level)."""
    brackets = outside_strings.translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        shorter = brackets.replace(b"()", b"")
        if len(shorter) == len(brackets):
            return False  # unbalanced: not JSON at all, which the decoder will say
        brackets = shorter
    return bool(brackets)


def _integer_too_big(token: bytes) -> bool:
    if len(token.lstrip(b"-")) > 19:  # JSON has no leading zeros: 20 digits is past 2**63
        return True
    return not MIN_INTEGER <= int(token) <= MAX_INTEGER


def bounds_problem(raw: bytes) -> str | None:
    """What makes the JSON text ``raw`` too deep or its integers too big, or None.

    ``raw`` need not be valid JSON; when it is not, the answer is None or a bound it breaks.
    """
    classes = raw.translate(_CLASSES)
    deep = classes.count(b"(") > MAX_DEPTH
    long_digits = _NINETEEN_DIGITS in classes
    if not (deep or long_digits):
        return None
    outside_strings = _STRING.sub(b'""', raw)
    if deep and _depth_exceeds(outside_strings, MAX_DEPTH):
        return f"JSON nested deeper than {MAX_DEPTH} levels"
    if long_digits:
        for match in _LONG_INTEGER.finditer(outside_strings):
            if _integer_too_big(match.group()):
                return f"an integer outside the 64-bit signed range ({MIN_INTEGER} to {MAX_INTEGER})"
    return None


class _TooBig(str):
    """An integer token outside the bounds, kept as its text (``integer_path`` looks for it)."""


def _integer_or_marker(token: str) -> int | _TooBig:
    return _TooBig(token) if _integer_too_big(token.encode()) else int(token)


def integer_path(raw: bytes) -> str | None:
    """Where in the JSON text ``raw`` the first integer outside the 64-bit range is, as a path
    such as ``body.max_tokens`` or ``body.messages[0].content``; None where ``raw`` is not JSON
    within the depth bound, or holds no such integer. Slow: call it once ``bounds_problem`` has
    found one."""
    try:
        document = json.loads(raw, parse_int=_integer_or_marker)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _TooBig):
            return path or None
        if isinstance(value, dict):
            items = [(f"{path}.{key}" if path else str(key), item) for key, item in value.items()]
        elif isinstance(value, list):
            items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
        else:
            continue
        stack.extend(reversed(items))  # depth first, in document order
    return None


def lines_within_bounds(block: bytes) -> bool:
    """True when no line of ``block`` (lines separated by newlines) can break a bound: the first
    look of ``bounds_problem`` passes for every line. False means: look at each line."""
    if _TOO_MANY_OPENINGS in block.translate(_OPENINGS, _NOT_OPENINGS):
        return False
    return _NINETEEN_DIGITS not in block.translate(_CLASSES)  # a newline is no digit: runs stay in a line
