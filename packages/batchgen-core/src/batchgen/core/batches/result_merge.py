"""The best result so far for every request of a batch and its retries (the merged view).

A batch's *family* is the batch, the batches made as its retries (``retry_of``), their retries,
and so on, taken in the order they were created. For each line of the batch's input file, the
lines the family's output and error files hold for its ``custom_id`` are ranked:

- a **success** (a ``response`` whose ``status_code`` is below 400, and no ``error``) beats a
  **failure** (an ``error``, or a ``status_code`` of 400 or more);
- between two of the same rank, the line of the later batch wins (the later attempt);
- a ``custom_id`` with no line in any of the family's files **never ran** (a cancel or an expiry
  dropped it before it ran): it has no line in the merged view.

``FamilyIndex`` holds that ranking with bounded memory: one pass over the input file and one over
each result file fill a SQLite index in a temporary file under the storage's staging folder (the
input line's place, offset and length; the winning line's file, offset and length; never the
lines themselves), and the merged view is then read back from the result files themselves, line
by line with ``pread``, in the order of the input file. Nothing is copied; the index is deleted
when closed (and, should the process die first, with the staging folder at the next start).
Only complete lines count: a line still being written (a retry running) is left for later.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sqlite3
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from batchgen.core.requests.line_outcomes import LineOutcome, outcome

__all__ = ["FamilyIndex", "Outcome", "is_success"]

#: Rows written to the index per statement, and bytes of the merged view handed out per chunk.
_ROWS_PER_WRITE = 4096
CHUNK_BYTES = 256 * 1024
#: The index's page cache: what bounds its memory, however large the batch.
_CACHE_KIB = 8 * 1024


class Outcome(enum.IntEnum):
    """What became of one request across a family, best last (the rank stored in the index)."""

    NOT_RUN = 0
    FAILED = 1
    SUCCEEDED = 2


class _Envelope(msgspec.Struct):
    custom_id: str


class _Response(msgspec.Struct):
    status_code: int = 200


class _ResultLine(msgspec.Struct):
    custom_id: str
    response: _Response | None = None
    error: Any = None


_read_envelope = msgspec.json.Decoder(_Envelope).decode
_read_result = msgspec.json.Decoder(_ResultLine).decode


def is_success(line: _ResultLine) -> bool:
    """Whether a result line is a success (``requests.line_outcomes``, the rule the batches'
    counts go by): a response below 400 and no error."""
    status_code = None if line.response is None else line.response.status_code
    return outcome(status_code, line.error) is LineOutcome.COMPLETED


def _complete_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of each complete non-blank line of ``path``; none if it does not exist."""
    try:
        stream = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return
    with stream:
        position = 0
        for raw in stream:
            if not raw.endswith(b"\n"):
                return  # being written: not a result yet
            if raw.strip():
                yield position, raw
            position += len(raw)


class FamilyIndex:
    """The ranking of one family's result lines, on disk; use as a context manager (or ``close``)."""

    def __init__(self, path: Path, scratch: Sequence[Path] = ()) -> None:
        """A new index in a database at ``path``; ``scratch`` are files it owns (local copies of
        result files held elsewhere), deleted with it."""
        self._path = path
        self._scratch = tuple(scratch)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", f"cache_size=-{_CACHE_KIB}"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute(
            "CREATE TABLE lines (line INTEGER PRIMARY KEY, custom_id TEXT NOT NULL UNIQUE, "
            "in_offset INTEGER NOT NULL, in_length INTEGER NOT NULL, rank INTEGER NOT NULL DEFAULT 0, "
            "source INTEGER, offset INTEGER, length INTEGER)"
        )
        self._sources: list[Path] = []

    @classmethod
    def build(
        cls, path: Path, input_path: Path, result_files: Sequence[Path], scratch: Sequence[Path] = ()
    ) -> FamilyIndex:
        """Index the input file at ``input_path`` and the family's ``result_files`` (each batch's
        output then error file, the batches oldest first), in a new database at ``path``; the
        ``scratch`` files go when the index does, built or not.

        A slow call (it reads every file once): run it in a worker thread.
        """
        index = cls(path, scratch)
        try:
            index._add_input(input_path)
            for result_file in result_files:
                index._add_results(result_file)
        except BaseException:
            index.close()
            raise
        return index

    def _add_input(self, input_path: Path) -> None:
        rows: list[tuple[int, str, int, int]] = []
        self._db.execute("BEGIN")
        with open(input_path, "rb") as stream:
            position, line = 0, 0
            for raw in stream:
                if raw.strip():
                    rows.append((line, _read_envelope(raw).custom_id, position, len(raw)))
                    line += 1
                    if len(rows) >= _ROWS_PER_WRITE:
                        self._db.executemany(
                            "INSERT INTO lines VALUES (?, ?, ?, ?, 0, NULL, NULL, NULL)", rows
                        )
                        rows.clear()
                position += len(raw)
        self._db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, 0, NULL, NULL, NULL)", rows)
        self._db.execute("COMMIT")

    def _add_results(self, result_file: Path) -> None:
        source = len(self._sources)
        self._sources.append(result_file)
        rows: list[tuple[int, int, int, int, str, int]] = []
        update = (
            "UPDATE lines SET rank = ?, source = ?, offset = ?, length = ? WHERE custom_id = ? AND rank <= ?"
        )
        self._db.execute("BEGIN")
        for offset, raw in _complete_lines(result_file):
            try:
                line = _read_result(raw)
            except msgspec.DecodeError:
                continue  # not a result line (the service writes none such)
            rank = Outcome.SUCCEEDED if is_success(line) else Outcome.FAILED
            rows.append((rank, source, offset, len(raw), line.custom_id, rank))
            if len(rows) >= _ROWS_PER_WRITE:
                self._db.executemany(update, rows)
                rows.clear()
        self._db.executemany(update, rows)
        self._db.execute("COMMIT")

    # --- reading ---------------------------------------------------------------------------
    def counts(self) -> dict[Outcome, int]:
        """How many input lines have each outcome so far."""
        found = dict(self._db.execute("SELECT rank, COUNT(*) FROM lines GROUP BY rank").fetchall())
        return {outcome: int(found.get(int(outcome), 0)) for outcome in Outcome}

    def input_spans(self, outcomes: frozenset[Outcome]) -> Iterator[tuple[int, int]]:
        """(offset, length) in the input file of each line whose outcome is one of ``outcomes``,
        in input order."""
        ranks = sorted(int(outcome) for outcome in outcomes)
        placeholders = ", ".join("?" for _ in ranks)
        query = f"SELECT in_offset, in_length FROM lines WHERE rank IN ({placeholders}) ORDER BY line"
        yield from self._db.execute(query, ranks)

    def merged_size(self) -> int:
        """The bytes of the merged view: its lines' lengths summed."""
        return int(
            self._db.execute("SELECT COALESCE(SUM(length), 0) FROM lines WHERE rank > 0").fetchone()[0]
        )

    def merged_chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Generator[bytes, None, None]:
        """The merged view: the winning line of every request that has one, in input order, read
        from the result files in chunks of about ``chunk_bytes``."""
        descriptors: dict[int, int] = {}
        try:
            buffer: list[bytes] = []
            held = 0
            query = "SELECT source, offset, length FROM lines WHERE rank > 0 ORDER BY line"
            for source, offset, length in self._db.execute(query):
                fd = descriptors.get(source)
                if fd is None:
                    fd = descriptors[source] = os.open(self._sources[source], os.O_RDONLY)
                buffer.append(os.pread(fd, length, offset))
                held += length
                if held >= chunk_bytes:
                    yield b"".join(buffer)
                    buffer.clear()
                    held = 0
            if buffer:
                yield b"".join(buffer)
        finally:
            for fd in descriptors.values():
                os.close(fd)

    def close(self) -> None:
        """Close the index and delete its file and its scratch files."""
        self._db.close()
        for owned in (self._path, *self._scratch):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(owned)

    def __enter__(self) -> FamilyIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
