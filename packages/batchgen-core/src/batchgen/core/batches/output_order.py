"""The ``output_order`` option, and rewriting a finished result file in input-line order.

A batch's result lines are appended as its requests finish (``"completion"``, the default). With
``"input"``, once the batch is done its output and error files are rewritten so that their lines
follow the order of the input file's request lines, without holding the lines in memory:

1. one pass over the input puts its custom_ids into a hash table of 64-bit hashes and line
   numbers (two ``array`` columns, 16 bytes a slot, at most half full) and notes where each
   request line starts;
2. one pass over the result file finds each line's input line number through that table and
   notes where the line lies (its offset and length, 12 bytes a line); the table is then freed;
3. the lines are copied in input order into ``{name}.ordering`` beside the file, in reads of
   neighbouring lines, through a small write buffer; that file is fsynced, renamed over the result
   file in one ``os.replace`` and the folder is fsynced.

Memory is therefore about 60 bytes per input line, whatever the lines hold. Readers never see a
half-made file: until the rename they read the file as it was appended (a download already under
way keeps reading it), afterwards the whole ordered one. A crash before the rename leaves the
appended file as it was and a stray ``.ordering`` file, which the next rewrite overwrites; a
crash after it leaves the ordered file, and rewriting an ordered file gives the same bytes.

The custom_ids of an input file are unique (upload validation), and every result line's
custom_id comes from the input, so a hash identifies its line unless two input custom_ids share
one: then each match is confirmed by reading the input line back.
"""

from __future__ import annotations

import contextlib
import os
from array import array
from pathlib import Path
from typing import Any

import attrs
import msgspec

from batchgen.core.errors import InvalidRequest
from batchgen.core.storage.durable_folders import sync_folder

COMPLETION = "completion"
INPUT = "input"
#: The orders a batch's result files can have.
OUTPUT_ORDERS = (COMPLETION, INPUT)
#: Suffix of the file an ordered rewrite is written to before it replaces the result file.
ORDERING_SUFFIX = ".ordering"
#: The most bytes one read of neighbouring lines takes, and the write buffer.
_COPY_BYTES = 1 << 20


class _CustomId(msgspec.Struct):
    custom_id: str


_decode_id = msgspec.json.Decoder(_CustomId).decode


def check_output_order(value: Any) -> str:
    """The output order a create call asks for (None: the server's default is used by the caller);
    InvalidRequest naming ``output_order`` for anything but "completion" or "input"."""
    if value not in OUTPUT_ORDERS or not isinstance(value, str):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InvalidRequest(
            f"output_order must be 'completion' or 'input', got {shown}",
            param="output_order",
            code="invalid_value",
        )
    return value


class UnorderableResults(ValueError):
    """A result file holds a line whose custom_id is not an input line's, or two lines for one
    input line: it is left as it is."""


@attrs.frozen
class Rewrite:
    """What one rewrite did: the lines it put in order, and the bytes it wrote."""

    lines: int
    bytes: int


def ordering_path(result_path: Path) -> Path:
    """Where the ordered copy of ``result_path`` is made before it replaces it."""
    return result_path.with_name(result_path.name + ORDERING_SUFFIX)


def rewrite_in_input_order(input_path: str | os.PathLike[str], result_path: Path) -> Rewrite:
    """Rewrite ``result_path`` (if it exists) with its lines in the order of the input file's
    request lines, atomically (see the module docstring); raise UnorderableResults, leaving it
    untouched, if its lines do not map one to one onto input lines, and OSError on a storage fault
    (the result file is then untouched as well)."""
    if not result_path.exists():
        return Rewrite(0, 0)
    temporary = ordering_path(result_path)
    with open(input_path, "rb", buffering=_COPY_BYTES) as input_file:
        offsets, lengths = _locate_lines(input_file, result_path)
    count = len(offsets)
    written = 0
    source = os.open(result_path, os.O_RDONLY)
    try:
        with open(temporary, "wb", buffering=_COPY_BYTES) as target:
            line = 0
            while line < count:
                length = lengths[line]
                if length < 0:
                    line += 1
                    continue
                start, end = offsets[line], offsets[line] + length
                line += 1
                # neighbouring lines (an already ordered stretch) in one read
                while line < count and offsets[line] == end and end - start < _COPY_BYTES:
                    if lengths[line] < 0:
                        break
                    end += lengths[line]
                    line += 1
                target.write(_pread_all(source, end - start, start))
                written += end - start
            target.flush()
            os.fsync(target.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    finally:
        os.close(source)
    os.replace(temporary, result_path)
    sync_folder(result_path.parent)
    return Rewrite(sum(1 for length in lengths if length >= 0), written)


def _locate_lines(input_file: Any, result_path: Path) -> tuple[array, array]:
    """For each input request line (the non-blank lines, numbered as ``batch_file.LineIndex``
    numbers them), where its result line lies in ``result_path`` (offset, length; length -1 when
    it has none)."""
    bound = _newlines(input_file) + 1  # at least the number of request lines
    size = 1 << max(4, (2 * bound).bit_length())  # at most half full
    mask = size - 1
    hashes = array("q", bytes(8 * size))
    slots = array("q", bytes(8 * size))  # input line number + 1; 0 is an empty slot
    starts = array("q")  # where each input request line starts
    shared = False  # two input custom_ids with one hash: matches are confirmed by reading
    position = 0
    input_file.seek(0)
    for raw in input_file:
        if raw.strip():
            key = hash(_decode_id(raw).custom_id)
            slot = key & mask
            while slots[slot]:
                if hashes[slot] == key:
                    shared = True
                slot = (slot + 1) & mask
            hashes[slot] = key
            starts.append(position)
            slots[slot] = len(starts)
        position += len(raw)
    count = len(starts)

    def input_custom_id(number: int) -> str:
        input_file.seek(starts[number])
        return _decode_id(input_file.readline()).custom_id

    offsets = array("q", bytes(8 * count))
    lengths = array("l", [-1]) * count
    position = 0
    with open(result_path, "rb") as results:
        for raw in results:
            if not raw.endswith(b"\n"):  # a torn last line: recovery cuts it, never here
                raise UnorderableResults(f"{result_path} ends in a partial line")
            custom_id = _decode_id(raw).custom_id
            key = hash(custom_id)
            slot = key & mask
            number = -1
            while slots[slot]:
                if hashes[slot] == key and (not shared or input_custom_id(slots[slot] - 1) == custom_id):
                    number = slots[slot] - 1
                    break
                slot = (slot + 1) & mask
            if number < 0:
                raise UnorderableResults(f"{result_path}: custom_id {custom_id!r} is not in the input")
            if lengths[number] >= 0:
                raise UnorderableResults(f"{result_path}: two lines for custom_id {custom_id!r}")
            offsets[number] = position
            lengths[number] = len(raw)
            position += len(raw)
    return offsets, lengths


def _newlines(stream: Any) -> int:
    count = 0
    stream.seek(0)
    while block := stream.read(_COPY_BYTES):
        count += block.count(b"\n")
    return count


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:  # the file shrank under us: nothing else writes it while it is ordered
        raise OSError(f"short read at {offset} of a result file")
    return data


def remove_leftovers(folder: Path) -> None:
    """Delete ordered copies a crash left unfinished (the result files themselves are whole)."""
    if not folder.is_dir():
        return
    for leftover in folder.glob(f"*{ORDERING_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()
