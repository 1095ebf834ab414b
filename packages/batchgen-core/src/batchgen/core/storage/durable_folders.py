"""Making a folder's entries durable: after a file is created or renamed in it, ``sync_folder``
fsyncs the folder itself, so the new name survives a crash of the machine, not just the file's
bytes (POSIX keeps the two apart)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["sync_folder"]


def sync_folder(folder: Path) -> None:
    """fsync ``folder``: the names created, renamed or removed in it so far are on disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
