"""Append-only local result files: one JSON line per finished request, and reading them back.

``OutputWriter`` is the local-disk ``ResultWriter`` (``storage.interfaces``).

Durability policy. Each line is handed to the operating system with one ``write`` the moment its
request finishes, so a crash of the process loses no finished line. ``sync`` (fsync) makes the
lines written so far survive a power loss too; the service calls it for every open file on a timer
(``fsync_interval_ms``, grouped across requests) and when a batch ends, never per request.

A write that fails (a full disk, say) is undone: the file is cut back to its last complete line, so
no written line is ever damaged. ``read_finished_lines`` is the recovery side: it cuts off a torn
last line left by a crash and returns what the complete lines record.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

import attrs
import msgspec

from batchgen.core.requests.line_outcomes import LineOutcome, line_outcome

_decode = msgspec.json.Decoder().decode


class OutputWriter:
    """Appends lines to one file, opened lazily on the first line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._size = 0
        self._unsynced = False
        self.closed = False

    @property
    def opened(self) -> bool:
        return self._fd is not None

    def append(self, line: bytes) -> None:
        """Write one complete line (ending in a newline); raise OSError, leaving the file whole."""
        if self.closed:
            raise ValueError(f"{self.path} is closed")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            with contextlib.suppress(OSError):  # undo a partial line; the original error matters
                os.ftruncate(self._fd, self._size)
            raise
        self._size += written
        self._unsynced = True

    def sync(self) -> None:
        """fsync what was written since the last sync (a no-op when nothing was)."""
        if self._fd is not None and self._unsynced:
            os.fsync(self._fd)
            self._unsynced = False

    def close(self) -> None:
        """Sync and close; later appends raise. Closing twice is harmless."""
        self.closed = True
        if self._fd is not None:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = None


@attrs.frozen
class FinishedLines:
    """What the complete lines of an output or error file record."""

    custom_ids: list[str]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failed: int = 0  # lines that record a failure (``requests.line_outcomes``)
    #: Lines the result cache answered (``"cached": true``), and their tokens.
    cached: int = 0
    cached_prompt_tokens: int = 0
    cached_completion_tokens: int = 0
    #: Prompt tokens of the other complete lines that the engines' prefix caches served (their
    #: usage's ``cached_tokens``; a replayed line's are the result cache's).
    prefix_cached_tokens: int = 0

    @property
    def completed(self) -> int:
        return len(self.custom_ids) - self.failed


def read_finished_lines(path: Path) -> FinishedLines:
    """Read the complete lines of ``path``, first cutting off a torn last line."""
    if not path.exists():
        return FinishedLines([])
    with open(path, "r+b") as stream:
        data = stream.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            stream.truncate(end)
    custom_ids: list[str] = []
    prompt_tokens = completion_tokens = failed = 0
    cached = cached_prompt = cached_completion = prefix_cached = 0
    for raw in data[:end].splitlines():
        if not raw.strip():
            continue
        line = _decode(raw)
        custom_ids.append(line["custom_id"])
        response = line.get("response")
        if line_outcome(raw) is LineOutcome.FAILED:  # the rule the running batch counted it by
            failed += 1
        elif response:
            prompt, completion, cached_tokens = line_tokens(response["body"].get("usage") or {})
            prompt_tokens += prompt
            completion_tokens += completion
            if line.get("cached"):
                cached += 1
                cached_prompt += prompt
                cached_completion += completion
            else:
                prefix_cached += cached_tokens
    return FinishedLines(
        custom_ids,
        prompt_tokens,
        completion_tokens,
        failed,
        cached,
        cached_prompt,
        cached_completion,
        prefix_cached,
    )


def line_tokens(usage: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of a response body's ``usage``: chat,
    completions and embeddings name them ``prompt_tokens``, ``completion_tokens`` and
    ``prompt_tokens_details.cached_tokens``; a ``/v1/responses`` body ``input_tokens``,
    ``output_tokens`` and ``input_tokens_details.cached_tokens``."""
    if "input_tokens" in usage:
        prompt, completion = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
        details = usage.get("input_tokens_details")
    else:
        prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    return prompt, completion, cached
