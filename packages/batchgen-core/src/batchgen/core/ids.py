"""Identifiers: unguessable ones for files and batches, cheap unique ones for each request.

File and batch ids name objects a client fetches by id, so they are 96 fresh random bits. The ids
of a request and its result lines (``req_…``, ``batch_req_…``, ``chatcmpl-…``) only need to be
unique, and three are made per request: they are a random per-process prefix (48 bits) and a
counter, unique across processes and restarts and far cheaper than fresh randomness.
"""

from __future__ import annotations

import itertools
import secrets

_PROCESS_PREFIX = secrets.token_hex(6)
_counter = itertools.count(int.from_bytes(secrets.token_bytes(3), "big"))


def new_object_id(prefix: str) -> str:
    """A random identifier such as ``file-3f9a…`` (24 hex digits after the prefix)."""
    return f"{prefix}{secrets.token_hex(12)}"


def new_request_id(prefix: str) -> str:
    """A unique identifier such as ``batch_req_3f9a…`` (24 hex digits after the prefix)."""
    return f"{prefix}{_PROCESS_PREFIX}{next(_counter) & 0xFFFFFFFFFFFF:012x}"
