"""Append-only result files: writing one JSON line per finished request, and reading them back.

A line is written whole and flushed to the operating system as soon as its request finishes, so a
crash of the process loses no finished line. ``sync`` pushes written lines to the disk (fsync); the
service calls it when a batch ends. ``read_finished_lines`` is the recovery side: it truncates a
torn last line and returns the custom_ids already written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import msgspec

_decode = msgspec.json.Decoder().decode


class OutputWriter:
    """Appends lines to one file, opened lazily on the first line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stream: BinaryIO | None = None
        self.lines_written = 0

    @property
    def opened(self) -> bool:
        return self._stream is not None

    def append(self, line: bytes) -> None:
        """Write one complete line (ending in a newline) and flush it to the OS."""
        if self._stream is None:
            self._stream = open(self.path, "ab")  # noqa: SIM115 - held open for the batch's life
        self._stream.write(line)
        self._stream.flush()
        self.lines_written += 1

    def sync(self) -> None:
        if self._stream is not None:
            os.fsync(self._stream.fileno())

    def close(self) -> None:
        if self._stream is not None:
            self._stream.flush()
            os.fsync(self._stream.fileno())
            self._stream.close()
            self._stream = None


def read_finished_lines(path: Path) -> list[str]:
    """Return the custom_ids of the complete lines in ``path``, cutting off a torn last line."""
    if not path.exists():
        return []
    with open(path, "r+b") as stream:
        data = stream.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            stream.truncate(end)
    custom_ids: list[str] = []
    for raw in data[:end].splitlines():
        if raw.strip():
            custom_ids.append(_decode(raw)["custom_id"])
    return custom_ids
