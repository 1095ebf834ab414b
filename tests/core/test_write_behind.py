"""Large writes that do not pile up in the page cache: ``write_behind`` starts each file's
writeback as it grows, and ``segment_chunks(..., forget=True)`` lets pages go once validation read
them; neither changes a byte."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.files import streamed_validation, write_behind
from batchgen.core.files.streamed_validation import Segment, segment_chunks
from batchgen.core.files.write_behind import open_write_behind
from tests.examples import examples


@contextlib.contextmanager
def _folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="write-behind-") as name:
        yield Path(name)


@settings(max_examples=examples(40), deadline=None)
@given(
    before=st.binary(max_size=3000),
    position=st.integers(0, 3000),
    writes=st.lists(st.integers(1, 2500), max_size=12),
)
def test_the_file_holds_what_was_written_from_its_position(
    before: bytes, position: int, writes: list[int]
) -> None:
    with _folder() as folder, pytest.MonkeyPatch.context() as patch:
        patch.setattr(write_behind, "WRITE_BEHIND_BYTES", 1000)
        path = folder / "log"
        path.write_bytes(before)
        position = min(position, len(before))
        data = os.urandom(sum(writes))
        with open_write_behind(path, position=position) as stream:
            offset = 0
            for size in writes:
                assert stream.write(data[offset : offset + size]) == size
                offset += size
            started = stream.writebacks
        assert path.read_bytes() == before[:position] + data
        if sys.platform == "linux":  # writeback was started about every 1000 bytes written
            assert len(data) // (1000 + max(writes, default=0)) <= started <= len(data) // 1000


def test_a_new_file_is_made_anew() -> None:
    with _folder() as folder:
        path = folder / "part"
        path.write_bytes(b"old bytes, longer than the new")
        with open_write_behind(path) as stream:
            stream.write(b"new")
        assert path.read_bytes() == b"new"


@settings(max_examples=examples(40), deadline=None)
@given(
    data=st.binary(min_size=1, max_size=5000),
    cuts=st.lists(st.integers(0, 5000), max_size=5),
    size=st.integers(1, 700),
    skip=st.integers(0, 4),
)
def test_forgetting_pages_once_read_changes_no_byte(
    data: bytes, cuts: list[int], size: int, skip: int
) -> None:
    with _folder() as folder, pytest.MonkeyPatch.context() as patch:
        path = folder / "log"
        path.write_bytes(data)
        points = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
        segments = [Segment(str(path), start, end - start) for start, end in pairwise(points)]
        advised: list[tuple[int, int, int]] = []
        if hasattr(os, "posix_fadvise"):
            real = os.posix_fadvise

            def recording(fd: int, offset: int, length: int, advice: int) -> None:
                advised.append((offset, length, advice))
                real(fd, offset, length, advice)

            patch.setattr(streamed_validation.os, "posix_fadvise", recording)
        forgetting = b"".join(segment_chunks(segments, size, skip, forget=True))
        keeping = b"".join(segment_chunks(segments, size, skip))
        assert forgetting == keeping == data[skip:]
        if hasattr(os, "posix_fadvise"):  # each segment's pages, once read, and only with forget
            assert advised == [
                (segment.offset, segment.length, os.POSIX_FADV_DONTNEED) for segment in segments
            ]


def test_a_segment_cut_short_on_disk_is_an_error_not_fewer_bytes() -> None:
    with _folder() as folder:
        path = folder / "log"
        path.write_bytes(b"0123456789")
        with pytest.raises(OSError, match="missing"):
            b"".join(segment_chunks([Segment(str(path), 4, 10)]))
