"""A database held locked by someone else: a second, real SQLite connection (what another process
would open) holding ``BEGIN EXCLUSIVE`` on a file for the length of a ``with`` block."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def locked_elsewhere(database: Path) -> Iterator[sqlite3.Connection]:
    """Hold ``database`` locked (``BEGIN EXCLUSIVE``) inside the block; released at its end."""
    holder = sqlite3.connect(str(database), isolation_level=None, timeout=10)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        yield holder
        holder.execute("ROLLBACK")
    finally:
        holder.close()
