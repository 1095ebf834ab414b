"""Segment stores: written once each, read back only as far as committed, orphans found and collected.

Each test runs over both stores: ``SegmentFiles`` on real files (in-process) and ``S3Segments`` on a
real SeaweedFS (``live``). Any ``start``..``end`` range of the committed segments laid end to end
is exactly that slice of their bytes (an HTTP ``Range`` request maps onto it); a committed size
shorter than the object is all that is read; a key cannot be written twice nor point outside the
segments; a committed segment that is missing or short is an error, never a short answer; and
only objects the manifest does not list and older than the grace period are orphans.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.work.s3_segments import S3Segments
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.segment_store import SegmentMissing, SegmentStore, open_segment_store, segment_key
from batchgen.core.work.shards import ERRORS, OUTPUT, Segment
from tests.core.segment_stores import StoreFactory
from tests.examples import examples

payloads = st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=6)


def _committed(store: SegmentStore, contents: list[bytes], torn: bytes = b"") -> list[Segment]:
    """Write each payload as a segment (plus bytes past its committed size)."""
    manifest: list[Segment] = []
    for number, data in enumerate(contents):
        key = segment_key("batch_x", OUTPUT, 0, 1, number)
        store.write(key, data + torn)
        manifest.append(Segment("batch_x", OUTPUT, 0, number, 1, key, len(data), ()))
    return manifest


# each example makes its own store through the factory: nothing is shared between examples
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=examples(60))
@given(contents=payloads, torn=st.binary(max_size=8), data=st.data())
def test_any_range_of_the_committed_bytes_is_that_slice(
    new_store: StoreFactory, contents: list[bytes], torn: bytes, data: st.DataObject
) -> None:
    store = new_store()
    manifest = _committed(store, contents, torn)
    whole = b"".join(contents)
    assert store.size(manifest) == len(whole)
    assert b"".join(store.read(manifest)) == whole  # what lies past a committed size is never read
    start = data.draw(st.integers(0, len(whole)))
    end = data.draw(st.integers(start, len(whole)))
    assert b"".join(store.read(manifest, start, end)) == whole[start:end]


def test_a_key_is_written_once(new_store: StoreFactory) -> None:
    store = new_store()
    key = segment_key("batch_1", ERRORS, 3, 2, 0)
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
def test_keys_only_name_segments(batch_id: str, kind: str, numbers: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        segment_key(batch_id, kind, *numbers)


def test_a_manifest_key_outside_the_segments_is_refused(new_store: StoreFactory, tmp_path: Path) -> None:
    store = new_store()
    (tmp_path / "secret").write_bytes(b"not a segment")
    for key in ("../secret", "segments/../../secret", "files/file-1.jsonl"):
        with pytest.raises(ValueError):
            b"".join(store.read([Segment("batch_1", OUTPUT, 0, 0, 1, key, 13, ())]))
        with pytest.raises(ValueError):
            store.write(key, b"x")


def test_a_missing_or_short_committed_segment_is_an_error_not_a_short_answer(new_store: StoreFactory) -> None:
    store = new_store()
    key = segment_key("batch_1", OUTPUT, 0, 1, 0)
    store.write(key, b"abc")
    with pytest.raises(SegmentMissing):
        b"".join(store.read([Segment("batch_1", OUTPUT, 0, 0, 1, key, 10, ())]))
    absent = segment_key("batch_1", OUTPUT, 0, 1, 9)
    with pytest.raises(SegmentMissing):
        b"".join(store.read([Segment("batch_1", OUTPUT, 0, 0, 1, absent, 1, ())]))


def test_orphans_are_the_unlisted_segments_older_than_the_grace(new_store: StoreFactory) -> None:
    store = new_store()
    keys = [segment_key("batch_1", OUTPUT, 0, epoch, 0) for epoch in (1, 2, 3)]
    written_at = time.time()
    for key in keys:
        store.write(key, b"line\n")
    committed = {keys[0]}
    # just written: a writer about to commit them, so none is an orphan yet
    assert store.orphans(committed, {"batch_1"}, grace_s=60, now=written_at + 30) == []
    # past the grace: the unlisted ones are, of a batch the ledger knows; of another, none is
    assert store.orphans(committed, {"batch_1"}, grace_s=60, now=written_at + 120) == keys[1:]
    assert store.orphans(committed, {"batch_2"}, grace_s=60, now=written_at + 120) == []
    assert store.collect(keys[1:2]) == 1
    assert sorted(store.keys()) == [keys[0], keys[2]]


@pytest.mark.parametrize(
    "url",
    [
        "s3:///no-bucket",
        "s3://user:secret@bucket/prefix",
        "s3://bucket/prefix?endpoint=ftp://127.0.0.1:21",
        "s3://bucket/prefix?acl=public-read",
        "s3://bucket/" + "p" * 3000,
        "file://otherhost/shared",
        "file:relative/folder",
        "http://127.0.0.1:8333/bucket",
        "",
    ],
)
def test_a_bad_blob_url_is_refused_with_the_reason(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        open_segment_store(url, environ={})
    assert str(refused.value)


def test_blob_urls_open_their_store(tmp_path: Path) -> None:
    folder = tmp_path / "shared folder"
    files = open_segment_store(folder.as_uri())
    assert isinstance(files, SegmentFiles)
    assert files.root == folder
    s3 = open_segment_store(
        "s3://bucket/some/prefix?endpoint=http://127.0.0.1:9&region=eu-west-1", environ={}
    )
    assert isinstance(s3, S3Segments)
    assert repr(s3) == "S3Segments('s3://bucket/some/prefix')"


@pytest.mark.parametrize("damage", ["deleted", "cut short"])
def test_a_download_needing_a_lost_segment_is_refused_before_it_starts(
    new_store: StoreFactory, damage: str
) -> None:
    """A response announces its length before its bytes: a segment that is gone or shorter than
    committed, anywhere in the range asked for, is a 503 ``storage_unavailable`` before the first
    byte, never a 200 that stops short (the other segments' ranges are still served)."""
    import anyio

    from batchgen.core.errors import StorageUnavailable
    from batchgen.core.files.content import SegmentContent

    store = new_store()
    segments = _committed(store, [b"first line\n", b"second line\n", b"third line\n"])
    lost = segments[1]
    store._delete(lost.object_key)
    if damage == "cut short":
        store.write(lost.object_key, b"sec")
    content = SegmentContent.of(store, segments)

    async def read(start: int, stop: int) -> bytes:
        return b"".join([chunk async for chunk in await content.open(start, stop)])

    with pytest.raises(StorageUnavailable, match=lost.object_key):
        anyio.run(read, 0, content.size)
    first = segments[0].size
    with pytest.raises(StorageUnavailable):
        anyio.run(read, first - 1, first + 1)  # one byte of the lost one is enough
    assert anyio.run(read, 0, first) == b"first line\n"
    last_start = first + lost.size
    assert anyio.run(read, last_start, content.size) == b"third line\n"
