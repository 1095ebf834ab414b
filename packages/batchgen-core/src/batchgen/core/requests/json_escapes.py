"""What is wrong with a JSON text's ``\\u`` escapes, in words a user can act on.

The decoder's own words for a bad escape depend on where it stopped reading: a lone high
surrogate (``"\\ud800"``) is "Input data was truncated" or "unexpected end of hex escape", a
lone low one "invalid utf-16 surrogate pair". ``escape_problem`` finds the first bad escape
itself and says what it is (a lone surrogate, or a ``\\u`` without four hex digits) and at
which byte, so an upload's 400 names the real problem.
"""

from __future__ import annotations

import re

#: Every backslash escape, left to right: ``\\\\`` is one escape, so the ``u`` after it is text.
_ESCAPE = re.compile(rb"\\(u[0-9A-Fa-f]{0,4}|.)", re.DOTALL)
_HIGH = range(0xD800, 0xDC00)
_LOW = range(0xDC00, 0xE000)


def escape_problem(raw: bytes) -> str | None:
    """The first bad ``\\u`` escape of the JSON text ``raw`` and its byte offset, or None."""
    if b"\\u" not in raw:
        return None
    escapes = list(_ESCAPE.finditer(raw))
    for index, match in enumerate(escapes):
        text = match.group(1)
        if not text.startswith(b"u"):
            continue
        escape = match.group().decode("ascii", "replace")
        if len(text) < 5:
            return f"invalid \\u escape at byte {match.start()}: '{escape}' needs four hex digits"
        unit = int(text[1:], 16)
        if unit in _HIGH:
            following = escapes[index + 1] if index + 1 < len(escapes) else None
            paired = (
                following is not None
                and following.start() == match.end()
                and len(following.group(1)) == 5
                and following.group(1).startswith(b"u")
                and int(following.group(1)[1:], 16) in _LOW
            )
            if not paired:
                return (
                    f"lone surrogate '{escape}' at byte {match.start()}: a high surrogate must be "
                    "followed by a low one (\\udc00 to \\udfff); JSON text must be valid Unicode"
                )
        elif unit in _LOW:
            previous = escapes[index - 1] if index else None
            after_high = (
                previous is not None
                and previous.end() == match.start()
                and len(previous.group(1)) == 5
                and previous.group(1).startswith(b"u")
                and int(previous.group(1)[1:], 16) in _HIGH
            )
            if not after_high:
                return (
                    f"lone surrogate '{escape}' at byte {match.start()}: a low surrogate must follow "
                    "a high one (\\ud800 to \\udbff); JSON text must be valid Unicode"
                )
    return None
