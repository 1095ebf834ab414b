"""Reading request lines back in blocks (``line_blocks.read_spans``) gives exactly each line's bytes.

Whatever the lines are (short, longer than a block, ending in CRLF, the last one without a
newline, blank lines between them) and whichever of them are asked for, in whatever order (a
resumed batch asks for the lines not done yet, with gaps), each span read in blocks is the same
bytes a ``pread`` of that span alone returns, and the line the index recorded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.files.batch_file import index_batch_file
from batchgen.core.files.line_blocks import InputChanged, read_spans
from tests.examples import examples

#: Line contents: JSON-ish text, without line breaks (the file's own separators are added apart).
_TEXT = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]), max_size=300)


@st.composite
def files(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A file's bytes and its non-blank lines as the index sees them (each with its line ending)."""
    lines: list[bytes] = []
    data = b""
    count = draw(st.integers(1, 40))
    for number in range(count):
        if draw(st.booleans()) and draw(st.booleans()):
            data += draw(st.sampled_from([b"\n", b"\r\n", b"  \n"]))  # a blank line
        content = draw(_TEXT).encode()
        if draw(st.integers(0, 9)) == 0:  # now and then a line longer than any block here
            content += b"x" * draw(st.integers(100, 3000))
        content = b"{" + content + b"}"
        last = number == count - 1
        ending = draw(st.sampled_from([b"", b"\n", b"\r\n"] if last else [b"\n", b"\r\n"]))
        lines.append(content + ending)
        data += content + ending
    return data, lines


@settings(max_examples=examples(200), deadline=None)
@given(file=files(), data=st.data(), block_bytes=st.integers(1, 2048))
def test_spans_read_in_blocks_are_the_lines_the_index_recorded(
    tmp_path_factory: pytest.TempPathFactory,
    file: tuple[bytes, list[bytes]],
    data: st.DataObject,
    block_bytes: int,
) -> None:
    content, lines = file
    path = tmp_path_factory.mktemp("lines") / "input.jsonl"
    path.write_bytes(content)
    index = index_batch_file(str(path))
    assert len(index) == len(lines)
    positions = data.draw(st.lists(st.integers(0, len(lines) - 1), unique=True), label="positions")
    if data.draw(st.booleans(), label="file order"):
        positions.sort()
    spans = [(index.offsets[position], index.lengths[position]) for position in positions]
    fd = os.open(path, os.O_RDONLY)
    try:
        read = read_spans(fd, spans, block_bytes)
        alone = [os.pread(fd, length, offset) for offset, length in spans]
    finally:
        os.close(fd)
    assert read == alone
    assert read == [lines[position] for position in positions]


def test_a_file_shorter_than_its_index_says_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "input.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_spans(fd, [(9, 9), (0, 9)]) == [b'{"b": 2}\n', b'{"a": 1}\n']
        with pytest.raises(InputChanged):
            read_spans(fd, [(0, 9), (9, 20)])  # the second line was cut short after indexing
    finally:
        os.close(fd)
