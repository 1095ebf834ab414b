"""An upload's parts on disk (``upload_parts``): whatever the order the parts arrived in, however
many arrived at once (into files of their own), and whatever the order they are completed in, the
file assembled is their bytes in the order named; completed in the order they arrived, the log
itself becomes the file (nothing copied); and a crash at any point of assembling, or while a part
arrives, loses nothing received whole."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.errors import BatchGenError
from batchgen.core.files import upload_parts
from batchgen.core.files.streamed_validation import BomStrip
from batchgen.core.files.upload_parts import ASSEMBLED, PartFolder
from tests.examples import examples

BOM = b"\xef\xbb\xbf"


def _receive(folder: PartFolder, part_id: str, data: bytes, *, into_log: bool) -> None:
    destination = folder.destination(part_id, into_log=into_log)
    with destination.open() as stream:
        stream.write(data)
    folder.commit(destination, destination.received_bytes())


@st.composite
def _uploads(draw: st.DrawFn) -> tuple[dict[str, bytes], list[tuple[str, bool]], list[str]]:
    """Parts' bytes, the order they arrived in (each into the log or a file of its own), and the
    order a complete names (some of them, in any order)."""
    count = draw(st.integers(1, 6))
    parts = {f"part_{n}": draw(st.binary(min_size=1, max_size=300)) for n in range(count)}
    if draw(st.booleans()):
        first = next(iter(parts))
        parts[first] = BOM + parts[first]
    arrival = draw(st.permutations(list(parts)))
    arrived = [(part_id, draw(st.booleans())) for part_id in arrival]
    named = draw(
        st.one_of(
            st.just([part_id for part_id, into_log in arrived if into_log]).filter(bool),
            st.lists(st.sampled_from(list(parts)), min_size=1, unique=True),
        )
    )
    return parts, arrived, named


@contextlib.contextmanager
def _folder() -> Iterator[PartFolder]:
    """An upload's folder, with its record, deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="parts-") as name:
        path = Path(name)
        (path / "upload.json").write_text("{}")
        yield PartFolder(path)


@settings(max_examples=examples(150), deadline=None)
@given(upload=_uploads(), skip_bom=st.booleans())
def test_the_file_is_the_parts_in_the_order_named_and_the_log_is_renamed_when_it_can_be(
    upload: tuple[dict[str, bytes], list[tuple[str, bool]], list[str]], skip_bom: bool
) -> None:
    parts, arrived, named = upload
    with _folder() as folder:
        for part_id, into_log in arrived:
            _receive(folder, part_id, parts[part_id], into_log=into_log)
        assert {part_id: segment.length for part_id, segment in folder.parts().items()} == {
            part_id: len(data) for part_id, data in parts.items()
        }
        expected = b"".join(parts[part_id] for part_id in named)
        skip = len(BOM) if skip_bom and expected.startswith(BOM) else 0
        log_inode = folder.log.stat().st_ino if folder.log.exists() else None
        renamed = not skip and folder.whole_log(named)
        target = folder.assemble(named, [len(parts[part_id]) for part_id in named], skip, log_busy=False)
        assert target.read_bytes() == expected[skip:]
        assert (target.stat().st_ino == log_inode) is renamed  # renamed, or copied
        assert not folder.log.exists()
        left = {path.name for path in folder.folder.iterdir()} - {"upload.json", "arrived.index", ASSEMBLED}
        assert left == {
            f"{part_id}.part" for part_id, into_log in arrived if not into_log and part_id not in named
        }


def test_a_part_arriving_into_the_log_meanwhile_keeps_it_from_being_renamed() -> None:
    with _folder() as folder:
        _receive(folder, "a", b"first\n", into_log=True)
        _receive(folder, "b", b"second\n", into_log=True)
        late = folder.destination("c", into_log=True)
        with late.open() as stream:  # a part still arriving as the upload completes
            stream.write(b"third, cut short")
        target = folder.assemble(["a", "b"], [6, 7], 0, log_busy=True)
        assert target.read_bytes() == b"first\nsecond\n"


@settings(max_examples=examples(60), deadline=None)
@given(upload=_uploads(), crash_after=st.integers(0, 8), skip_bom=st.booleans())
def test_assembly_cut_by_a_crash_at_any_copy_resumes_to_the_same_file(
    upload: tuple[dict[str, bytes], list[tuple[str, bool]], list[str]], crash_after: int, skip_bom: bool
) -> None:
    parts, arrived, named = upload
    with _folder() as folder:
        for part_id, into_log in arrived:
            _receive(folder, part_id, parts[part_id], into_log=into_log)
        expected = b"".join(parts[part_id] for part_id in named)
        skip = len(BOM) if skip_bom and expected.startswith(BOM) else 0
        sizes = [len(parts[part_id]) for part_id in named]
        copy_range = upload_parts._copy_range
        calls = 0

        def crashing(source: str, offset: int, length: int, destination: object) -> None:
            nonlocal calls
            calls += 1
            if calls > crash_after:
                half = length // 2
                copy_range(source, offset, half, destination)  # type: ignore[arg-type]
                raise KeyboardInterrupt("the power went")
            copy_range(source, offset, length, destination)  # type: ignore[arg-type]

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(upload_parts, "_copy_range", crashing)
            with contextlib.suppress(KeyboardInterrupt):
                folder.assemble(named, sizes, skip, log_busy=False)
        target = PartFolder(folder.folder).assemble(named, sizes, skip, log_busy=False)
        assert target.read_bytes() == expected[skip:]


@given(
    whole=st.lists(st.binary(min_size=1, max_size=200), max_size=5),
    in_flight=st.binary(max_size=200),
    cut_index_line=st.booleans(),
    lost=st.integers(0, 300),
)
def test_repair_keeps_exactly_the_parts_received_whole(
    whole: list[bytes], in_flight: bytes, cut_index_line: bool, lost: int
) -> None:
    """What the index names whole stays; a part in flight, an index line cut short, and parts
    whose bytes the disk lost (the log shorter than the index says: ``lost``) go."""
    with _folder() as folder:
        for number, data in enumerate(whole):
            _receive(folder, f"p{number}", data, into_log=True)
        (folder.folder / "q.receiving").write_bytes(b"half a part")
        with open(folder.log, "ab") as stream:  # the part in flight when the server died
            stream.write(in_flight)
        if cut_index_line:
            with open(folder.index, "ab") as stream:
                stream.write(b'{"id": "p9", "off')
        on_disk = max(0, sum(map(len, whole)) + len(in_flight) - lost)
        os.truncate(folder.log, on_disk)
        ends = [sum(map(len, whole[: number + 1])) for number in range(len(whole))]
        kept = [number for number, end in enumerate(ends) if end <= on_disk]
        folder.repair()
        assert not (folder.folder / "q.receiving").exists()
        assert list(folder.log_parts()) == [f"p{number}" for number in kept]
        size = folder.log.stat().st_size if folder.log.exists() else 0
        assert size == sum(len(whole[number]) for number in kept)
        if kept:
            assert folder.assemble(
                list(folder.log_parts()), [len(whole[number]) for number in kept], 0, log_busy=False
            ).read_bytes() == b"".join(whole[number] for number in kept)
        # a new part then goes where the last whole one ended
        assert folder.destination("next", into_log=True).offset == size


def test_a_log_shorter_than_its_index_says_is_an_error_not_a_short_file() -> None:
    with _folder() as folder:
        _receive(folder, "a", b"0123456789", into_log=True)
        os.truncate(folder.log, 4)  # bytes the disk lost
        with pytest.raises(BatchGenError):
            folder.assemble(["a"], [10], 0, log_busy=False)


def test_a_part_refused_after_it_arrived_is_cut_off_the_log() -> None:
    with _folder() as folder:
        _receive(folder, "a", b"kept\n", into_log=True)
        refused = folder.destination("b", into_log=True)
        with refused.open() as stream:
            stream.write(b"refused\n")
        PartFolder.discard(refused)
        assert folder.log.read_bytes() == b"kept\n"
        assert [json.loads(line)["id"] for line in folder.index.read_text().splitlines()] == ["a"]


@settings(max_examples=examples(80), deadline=None)
@given(
    data=st.binary(max_size=40),
    with_mark=st.booleans(),
    cuts=st.lists(st.integers(0, 44), max_size=5),
    into_log=st.booleans(),
)
def test_a_byte_order_mark_cut_across_tiny_parts_is_left_out_however_it_is_read(
    data: bytes, with_mark: bool, cuts: list[int], into_log: bool
) -> None:
    """Parts of one or two bytes may cut the mark: validation's reading (``BomStrip``, chunk by
    chunk) and assembly (``skip`` across parts) both leave exactly the mark out."""
    whole = (BOM if with_mark else b"") + data
    points = sorted({0, len(whole), *(cut % (len(whole) + 1) for cut in cuts)})
    pieces = [whole[start:end] for start, end in itertools.pairwise(points) if end > start]
    strip = BomStrip()
    streamed = b"".join(strip.feed(piece) for piece in pieces) + strip.finish()
    expected = whole.removeprefix(BOM)
    assert streamed == expected and strip.skipped == len(whole) - len(expected)
    if not pieces:
        return
    with _folder() as folder:
        names = [f"p{number}" for number in range(len(pieces))]
        for name, piece in zip(names, pieces, strict=True):
            _receive(folder, name, piece, into_log=into_log)
        target = folder.assemble(names, [len(piece) for piece in pieces], strip.skipped, log_busy=False)
        assert target.read_bytes() == expected
