"""Segment files: written once each, read back only as far as committed, orphans found and collected.

In-process, on real files: any ``start``..``end`` range of the committed segments laid end to end
is exactly that slice of their bytes (an HTTP ``Range`` request maps onto it), a torn tail past a
segment's committed size is never read, a key cannot be written twice nor point outside the
segments folder, and only files the manifest does not list and older than the grace period are
orphans.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.work.segment_files import SegmentFiles, SegmentMissing
from batchgen.core.work.shards import ERRORS, OUTPUT, Segment

payloads = st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=6)


def _committed(store: SegmentFiles, contents: list[bytes], torn: bytes = b"") -> list[Segment]:
    """Write each payload as a segment (plus a torn tail that was never committed)."""
    manifest: list[Segment] = []
    for number, data in enumerate(contents):
        key = SegmentFiles.key("batch_x", OUTPUT, 0, 1, number + len(list(store.keys())))
        store.write(key, data + torn)
        manifest.append(Segment("batch_x", OUTPUT, 0, len(manifest), 1, key, len(data), ()))
    return manifest


@given(contents=payloads, torn=st.binary(max_size=8), data=st.data())
def test_any_range_of_the_committed_bytes_is_that_slice(
    tmp_path_factory: pytest.TempPathFactory, contents: list[bytes], torn: bytes, data: st.DataObject
) -> None:
    store = SegmentFiles(tmp_path_factory.mktemp("segments"))
    manifest = _committed(store, contents, torn)
    whole = b"".join(contents)
    assert store.size(manifest) == len(whole)
    assert b"".join(store.read(manifest)) == whole  # the torn tails are never read
    start = data.draw(st.integers(0, len(whole)))
    end = data.draw(st.integers(start, len(whole)))
    assert b"".join(store.read(manifest, start, end)) == whole[start:end]


def test_a_key_is_written_once(tmp_path: Path) -> None:
    store = SegmentFiles(tmp_path)
    key = SegmentFiles.key("batch_1", ERRORS, 3, 2, 0)
    assert key == "segments/batch_1/errors/3/2-0.jsonl"
    assert store.write(key, b"first\n") == 6
    with pytest.raises(FileExistsError):
        store.write(key, b"second\n")
    manifest = [Segment("batch_1", ERRORS, 3, 0, 2, key, 6, (0,))]
    assert b"".join(store.read(manifest)) == b"first\n"


@pytest.mark.parametrize(
    ("batch_id", "kind", "numbers"),
    [
        ("../etc", OUTPUT, (0, 1, 0)),
        ("batch/1", OUTPUT, (0, 1, 0)),
        ("", OUTPUT, (0, 1, 0)),
        ("batch_1", "results", (0, 1, 0)),
        ("batch_1", OUTPUT, (-1, 1, 0)),
        ("batch_1", OUTPUT, (0, -1, 0)),
    ],
)
def test_keys_only_name_files_in_the_segments_folder(
    batch_id: str, kind: str, numbers: tuple[int, int, int]
) -> None:
    with pytest.raises(ValueError):
        SegmentFiles.key(batch_id, kind, *numbers)


def test_a_manifest_key_outside_the_folder_is_refused(tmp_path: Path) -> None:
    store = SegmentFiles(tmp_path / "store")
    (tmp_path / "secret").write_bytes(b"not a segment")
    outside = Segment("batch_1", OUTPUT, 0, 0, 1, "../secret", 13, ())
    with pytest.raises(ValueError):
        b"".join(store.read([outside]))
    with pytest.raises(ValueError):
        store.write("segments/../../secret2", b"x")


def test_a_missing_or_short_committed_segment_is_an_error_not_a_short_answer(tmp_path: Path) -> None:
    store = SegmentFiles(tmp_path)
    key = SegmentFiles.key("batch_1", OUTPUT, 0, 1, 0)
    store.write(key, b"abc")
    with pytest.raises(SegmentMissing):
        b"".join(store.read([Segment("batch_1", OUTPUT, 0, 0, 1, key, 10, ())]))
    with pytest.raises(SegmentMissing):
        b"".join(store.read([Segment("batch_1", OUTPUT, 0, 0, 1, key.replace("1-0", "1-9"), 1, ())]))


def test_orphans_are_the_unlisted_files_older_than_the_grace(tmp_path: Path) -> None:
    store = SegmentFiles(tmp_path)
    keys = [SegmentFiles.key("batch_1", OUTPUT, 0, epoch, 0) for epoch in (1, 2, 3)]
    for key in keys:
        store.write(key, b"line\n")
    old = time.time() - 600
    for key in keys[:2]:
        os.utime(tmp_path / key, (old, old))
    committed = {keys[0]}
    # keys[1]: unlisted and old, an orphan; keys[2]: unlisted but fresh (a writer about to commit)
    assert store.orphans(committed, grace_s=60) == [keys[1]]
    assert store.collect(store.orphans(committed, grace_s=60)) == 1
    assert sorted(store.keys()) == [keys[0], keys[2]]
