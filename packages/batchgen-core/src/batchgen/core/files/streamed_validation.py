"""Validating a batch input file that arrives as a stream of byte chunks, with bounded memory.

``batch_file.validate_batch_file`` keeps every accepted ``custom_id`` in a set to find duplicates:
about 100 bytes a line, so 800 MB for an 8-million-line file. ``StreamedValidation`` runs the
same checks (the same ``_Validation`` over blocks of whole lines, lines numbered across chunk
boundaries) but keeps only a 64-bit hash of each ``custom_id`` (8 bytes a line, in arrays), and
finds duplicate hashes at the end:

- no line with a problem and no hash seen twice: the file is valid, exactly as the exact
  validation would have said (no two accepted lines share an id);
- otherwise (a problem, a real duplicate, or a hash collision) ``validate_exactly`` runs the exact
  validation again over the same bytes, remembering in full only the ids whose hash was
  suspect. It reports the same problems, with the same 1-based line numbers, as
  ``validate_batch_file`` on the whole file.

Hashes are Python's ``hash`` of the id (salted per process), so both passes run in one process.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Collection, Iterable, Iterator
from typing import Any, NamedTuple, cast

from batchgen.core.files.batch_file import VALIDATION_BLOCK_BYTES, BatchFileSummary, LineRouter, _Validation

#: Hash buckets the ids are spread over, so the duplicate check at the end works a bucket at a time.
BUCKET_BITS = 6
_MASK = (1 << BUCKET_BITS) - 1


class _HashedIds:
    """Stands in for ``_Validation.seen_ids`` in the first pass: says no id was seen before, and
    records the hash of every accepted id (``accepted``) and of every id of a line it rejected
    (``rejected``: a probe not followed by ``add``)."""

    def __init__(self) -> None:
        self.accepted = [array("q") for _ in range(1 << BUCKET_BITS)]
        self.rejected = [array("q") for _ in range(1 << BUCKET_BITS)]
        self._probed: int | None = None

    def __contains__(self, custom_id: object) -> bool:
        if self._probed is not None:  # the line probed before was not accepted
            self.rejected[self._probed & _MASK].append(self._probed)
        self._probed = hash(custom_id)
        return False

    def add(self, custom_id: str) -> None:
        value = hash(custom_id)
        self.accepted[value & _MASK].append(value)
        self._probed = None

    def isdisjoint(self, ids: Iterable[str]) -> bool:
        return True

    def __ior__(self, ids: Iterable[str]) -> _HashedIds:
        buckets = self.accepted
        for value in map(hash, ids):
            buckets[value & _MASK].append(value)
        return self

    def suspects(self) -> set[int]:
        """Hashes of ids that two accepted lines share, or an accepted and a rejected line."""
        if self._probed is not None:
            self.rejected[self._probed & _MASK].append(self._probed)
            self._probed = None
        found: set[int] = set()
        for accepted, rejected in zip(self.accepted, self.rejected, strict=True):
            unique = set(accepted)
            if len(unique) != len(accepted):
                once: set[int] = set()
                for value in accepted:
                    if value in once:
                        found.add(value)
                    once.add(value)
            if rejected:
                found |= unique.intersection(rejected)
        return found


class _SuspectIds:
    """``_Validation.seen_ids`` for the exact pass: a real set, but only of the suspect ids."""

    def __init__(self, suspects: set[int]) -> None:
        self._suspects = suspects
        self._seen: set[str] = set()

    def __contains__(self, custom_id: object) -> bool:
        return hash(custom_id) in self._suspects and custom_id in self._seen

    def add(self, custom_id: str) -> None:
        if hash(custom_id) in self._suspects:
            self._seen.add(custom_id)

    def isdisjoint(self, ids: Iterable[str]) -> bool:
        return not any(custom_id in self for custom_id in ids)

    def __ior__(self, ids: Iterable[str]) -> _SuspectIds:
        for custom_id in ids:
            self.add(custom_id)
        return self


class _Blocks:
    """Cuts chunks of any size into blocks of whole lines, numbering the lines across chunks."""

    def __init__(self, validation: _Validation) -> None:
        self._validation = validation
        self._carry = b""
        self.line_number = 1

    def feed(self, chunk: bytes) -> None:
        data = self._carry + chunk if self._carry else chunk
        cut = data.rfind(b"\n") + 1
        if not cut:  # inside a line longer than the chunk
            self._carry = data
            return
        self._carry = data[cut:]
        self.line_number += self._validation.check_block(self.line_number, data[:cut])

    def finish(self) -> None:
        if self._carry:
            self.line_number += self._validation.check_block(self.line_number, self._carry)
            self._carry = b""


class StreamedValidation:
    """The first pass over a file fed in order as chunks (``feed``), then ``finish``."""

    def __init__(self, served_models: Collection[str] | LineRouter | None = None) -> None:
        self._validation = _Validation(served_models)
        self._ids = _HashedIds()
        self._validation.seen_ids = cast(Any, self._ids)
        self._blocks = _Blocks(self._validation)
        self.bytes = 0

    def feed(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        self._blocks.feed(chunk)

    def finish(self) -> BatchFileSummary | set[int]:
        """The summary of a file found valid; else the suspect hashes ``validate_exactly`` needs
        (the file has a problem, or two lines may share an id)."""
        self._blocks.finish()
        validation = self._validation
        suspects = self._ids.suspects()
        if validation.problems or suspects or validation.count == 0:
            return suspects
        assert validation.file_url is not None
        return BatchFileSummary(line_count=validation.count, url=validation.file_url)


def validate_exactly(
    chunks: Iterable[bytes], served_models: Collection[str] | LineRouter | None, suspects: set[int]
) -> BatchFileSummary:
    """``validate_batch_file`` over ``chunks`` (the file in order), remembering only the ids
    whose hash is in ``suspects`` (as ``StreamedValidation.finish`` gave them for the same bytes);
    raises InvalidBatchFile with the problems and their line numbers."""
    validation = _Validation(served_models)
    validation.seen_ids = cast(Any, _SuspectIds(suspects))
    blocks = _Blocks(validation)
    for chunk in chunks:
        blocks.feed(chunk)
    blocks.finish()
    return validation.summary()


UTF8_BOM = b"\xef\xbb\xbf"


class BomStrip:
    """Leaves a UTF-8 byte order mark out of the start of a stream fed in chunks of any size, a
    mark cut across chunks (parts of one or two bytes) included; ``skipped``: its length, once
    known."""

    def __init__(self) -> None:
        self._head = b""
        self._decided = False
        self.skipped = 0

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` follows the mark (held back while it may still be the mark's start)."""
        if self._decided:
            return chunk
        self._head += chunk
        if len(self._head) < len(UTF8_BOM) and UTF8_BOM.startswith(self._head):
            return b""
        return self.finish()

    def finish(self) -> bytes:
        """The stream ended (or the mark is ruled out): what was held back, less the mark."""
        head, self._head, self._decided = self._head, b"", True
        if head.startswith(UTF8_BOM):
            self.skipped = len(UTF8_BOM)
            return head[len(UTF8_BOM) :]
        return head


class Segment(NamedTuple):
    """``length`` bytes of the file at ``path`` from ``offset``: a part of an upload, where it lies."""

    path: str
    offset: int
    length: int


def segment_chunks(
    segments: Iterable[Segment], size: int = VALIDATION_BLOCK_BYTES, skip: int = 0, *, forget: bool = False
) -> Iterator[bytes]:
    """The bytes of ``segments`` in order, ``size`` at a time; the first ``skip`` bytes left out.
    A segment shorter on disk than it says (a file cut meanwhile) raises OSError. ``forget``: once
    a segment is read, its pages leave the page cache (written back already, they are not read
    again soon: an upload of many gigabytes would otherwise fill the cache, and growing the cache
    by gigabytes costs more CPU than the validation)."""
    for path, offset, length in segments:
        with open(path, "rb") as stream:
            start = min(skip, length)
            skip -= start
            stream.seek(offset + start)
            left = length - start
            while left > 0:
                chunk = stream.read(min(size, left))
                if not chunk:
                    raise OSError(f"{path}: {left} bytes of a part are missing")
                left -= len(chunk)
                yield chunk
            if forget and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(stream.fileno(), offset, length, os.POSIX_FADV_DONTNEED)
