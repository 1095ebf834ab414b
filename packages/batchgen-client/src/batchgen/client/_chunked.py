"""`upload_file_chunked` as steps both clients take in the same order (the Uploads API):

chunked = upload_file_chunked(path, ...)          # a ChunkedUpload
upload = call(chunked.create())
part_ids = [call(chunked.part(upload, index))["id"] for index in range(chunked.part_count)]
return call(chunked.complete(upload, part_ids))   # the completed upload; its `file` is the file

Each part is read from disk when it is sent (and again on a retry), so a file of many gigabytes
never sits in memory whole; at most one part does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.client._exceptions import BatchGenClientError
from batchgen.client._requests import JSONObject, PartUpload, RequestSpec, StrPath, _segment

__all__ = [
    "DEFAULT_CHUNKED_THRESHOLD",
    "DEFAULT_PART_SIZE",
    "MAX_PART_SIZE",
    "ChunkedUpload",
    "upload_file_chunked",
]

#: The parts' size (the openai SDK's, and the most the server takes: 64 MiB).
DEFAULT_PART_SIZE = 64 * 1024 * 1024
MAX_PART_SIZE = DEFAULT_PART_SIZE
#: Files larger than this go through the Uploads API in `submit_batch` (and `batchgen submit`).
DEFAULT_CHUNKED_THRESHOLD = 256 * 1024 * 1024
UPLOAD_MIME_TYPE = "text/jsonl"


def upload_file_chunked(
    path: StrPath, purpose: str = "batch", *, part_size: int = DEFAULT_PART_SIZE, md5: bool = True
) -> ChunkedUpload:
    """Upload a file of any size through the Uploads API (POST /v1/uploads, its parts, then
    complete), in parts of `part_size` bytes read from disk one at a time. With `md5` (the
    default), the server checks the md5 of the whole file before it stores it. Returns the
    completed upload object; its `file` is the stored file (use its `id` for a batch)."""
    if not 1 <= part_size <= MAX_PART_SIZE:
        raise ValueError(f"part_size must be between 1 and {MAX_PART_SIZE} bytes, got {part_size}")
    source = Path(path)
    size = source.stat().st_size
    if size == 0:
        raise ValueError(f"{source} is empty")
    return ChunkedUpload(source, purpose, part_size, size, _md5(source) if md5 else None)


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class ChunkedUpload:
    """One chunked upload: the file, its purpose, its parts' size, its size and md5."""

    path: Path
    purpose: str
    part_size: int
    size: int
    md5: str | None

    @property
    def part_count(self) -> int:
        return -(-self.size // self.part_size)

    def create(self) -> RequestSpec:
        body = {
            "bytes": self.size,
            "filename": self.path.name,
            "mime_type": UPLOAD_MIME_TYPE,
            "purpose": self.purpose,
        }
        return RequestSpec("POST", "/v1/uploads", json=body)

    def part(self, upload: JSONObject, index: int) -> RequestSpec:
        offset = index * self.part_size
        length = min(self.part_size, self.size - offset)
        return RequestSpec(
            "POST", f"/v1/uploads/{_segment(_id(upload))}/parts", part=PartUpload(self.path, offset, length)
        )

    def complete(self, upload: JSONObject, part_ids: list[str]) -> RequestSpec:
        body: dict[str, Any] = {"part_ids": part_ids}
        if self.md5 is not None:
            body["md5"] = self.md5
        return RequestSpec("POST", f"/v1/uploads/{_segment(_id(upload))}/complete", json=body)


def _id(obj: JSONObject) -> str:
    value = obj.get("id")
    if not isinstance(value, str) or not value:
        raise BatchGenClientError(f"the server returned an object without an id: {obj!r}")
    return value


def part_id(part: JSONObject) -> str:
    return _id(part)


def completed_file(upload: JSONObject) -> JSONObject:
    """The file object of a completed upload."""
    file = upload.get("file")
    if not isinstance(file, dict):
        raise BatchGenClientError(f"the completed upload names no file: {upload!r}")
    return file
