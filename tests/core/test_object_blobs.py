"""ObjectBlobStore's faults: an object store that cannot be reached is a storage fault, never a bug.

An ``ObjectBlobStore`` pointed at a port where nothing listens fails to publish and to fetch within
its bounded retries, and ``storage_fault`` calls both a ``StorageUnavailable`` naming the object
store; an object that is not there is an answer (FileNotFoundError), not a fault. The service's
upload over such a store answers ``StorageUnavailable`` and leaves neither a local copy nor a row.
The store's URL is checked before anything is built: credentials belong in the environment.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from batchgen.core import BatchService, ServiceSettings, load_backend
from batchgen.core.errors import StorageUnavailable
from batchgen.core.storage.faults import storage_fault
from batchgen.core.storage.object_blobs import ObjectBlobStore
from tests.helpers import chat_line, jsonl
from tests.live import free_port
from tests.seaweedfs import SeaweedServer

_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


def _unreachable(root: Path) -> ObjectBlobStore:
    return ObjectBlobStore.from_url(
        f"s3://bucket/prefix?endpoint=http://127.0.0.1:{free_port()}", root, _CREDENTIALS
    )


def test_an_unreachable_store_is_a_storage_fault_for_publish_and_fetch(tmp_path: Path) -> None:
    blobs = _unreachable(tmp_path)
    path = blobs.upload_path("file-0123456789abcdef01234567")
    path.write_bytes(b'{"custom_id":"a"}\n')
    started = time.monotonic()
    with pytest.raises(Exception) as published:
        blobs.publish(path)
    with pytest.raises(Exception) as fetched:
        _unreachable(tmp_path / "other").readable(str(path))
    assert time.monotonic() - started < 30  # bounded retries, not a hang
    for raised in (published.value, fetched.value):
        fault = storage_fault(raised, "store the file")
        assert isinstance(fault, StorageUnavailable), raised
        assert "object store" in str(fault)


@pytest.mark.live
def test_a_missing_object_is_an_answer_not_a_fault(tmp_path: Path, seaweed_server: SeaweedServer) -> None:
    blobs = ObjectBlobStore.from_url(
        seaweed_server.url(f"missing-{time.time_ns()}"), tmp_path, seaweed_server.environ
    )
    with pytest.raises(FileNotFoundError) as missing:
        blobs.readable(str(tmp_path / "file-0123456789abcdef01234567.jsonl"))
    assert storage_fault(missing.value) is None
    assert list(blobs.files_dir.iterdir()) == []  # no partial copy is left behind


@pytest.mark.parametrize("name", ["../../etc/passwd", "file-x.jsonl.part", "upload-1.part", "file-.jsonl"])
def test_only_a_stored_files_name_is_published_or_fetched(tmp_path: Path, name: str) -> None:
    blobs = _unreachable(tmp_path)
    with pytest.raises(ValueError, match="not the name of a stored file"):
        blobs.readable(str(tmp_path / name))
    with pytest.raises(ValueError, match="not the name of a stored file"):
        blobs.publish(tmp_path / name)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("s3://me:secret@bucket/p", "AWS_ACCESS_KEY_ID"),
        ("s3:///p", "s3://BUCKET"),
        ("s3://bucket/p?endpoint=ftp://host", "http:// or https://"),
        ("s3://bucket/p?colour=blue", "unknown s3:// URL parameters"),
        ("s3://bucket/" + "p" * 3000, "at most"),
    ],
)
def test_a_bad_store_url_is_refused_saying_why(tmp_path: Path, url: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        ObjectBlobStore.from_url(url, tmp_path, _CREDENTIALS)


@pytest.mark.anyio
async def test_an_upload_while_the_store_is_down_fails_and_leaves_nothing(tmp_path: Path) -> None:
    blobs = _unreachable(tmp_path / "blobs")
    settings = ServiceSettings(storage_path=tmp_path / "storage")
    async with BatchService(settings, load_backend("simulated"), blobs=blobs) as service:
        with pytest.raises(StorageUnavailable, match="object store"):
            await service.create_file(jsonl(chat_line("a")), filename="in.jsonl", purpose="batch")
        files, _ = await service.list_files(after=None, limit=100, order="asc", purpose=None)
        assert files == []
    assert list(blobs.files_dir.iterdir()) == [] and list(blobs.staging_dir.iterdir()) == []
