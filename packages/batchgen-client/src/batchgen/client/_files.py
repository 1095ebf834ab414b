"""Local files, for both clients: picking the endpoint from an input file's first request, and
downloading to a path so that a half-finished download never sits there."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from batchgen.client._requests import DEFAULT_ENDPOINT, RequestSpec, StrPath, file_content

__all__ = ["Download", "download_file_to", "endpoint_of", "partial_download"]


def endpoint_of(input_file_path: StrPath) -> str:
    """The `url` of the first request in a JSONL input file (the batch endpoint it targets).

    Falls back to `/v1/chat/completions` when the first non-blank line is not a JSON object with
    a string `url`: the server validates the file and reports such problems line by line.
    """
    with Path(input_file_path).open("r", encoding="utf-8-sig") as handle:
        for line in handle:
            if line.strip():
                break
        else:
            return DEFAULT_ENDPOINT
    try:
        first = json.loads(line)
    except ValueError:
        return DEFAULT_ENDPOINT
    url = first.get("url") if isinstance(first, dict) else None
    return url if isinstance(url, str) and url else DEFAULT_ENDPOINT


@contextmanager
def partial_download(path: StrPath) -> Iterator[BinaryIO]:
    """Open `<path>.part` for writing; on success it replaces `path`, on error it is removed."""
    target = Path(path)
    partial = target.with_name(target.name + ".part")
    try:
        with partial.open("wb") as handle:
            yield handle
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


@dataclass(frozen=True, slots=True)
class Download:
    """A file's content, to be streamed to `path` through `partial_download`."""

    spec: RequestSpec
    path: Path


def download_file_to(file_id: str, path: StrPath) -> Download:
    """Stream a file's content to `path` (via `<path>.part`, renamed once complete)."""
    return Download(file_content(file_id), Path(path))
