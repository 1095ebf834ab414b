"""Blob URLs: where replicas keep the contents of files, and what each kind of URL names.

``--blob-url`` is ``file:///folder`` (a folder every replica mounts at the same path) or
``s3://BUCKET/PREFIX?endpoint=...&region=...`` (an S3-compatible store, whose rules are
``s3_objects.check_s3_url``). ``shared_folder`` tells the two apart and checks the URL without
importing an object store's client or opening anything.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from batchgen.core.storage.s3_objects import check_s3_url

__all__ = ["shared_folder"]


def shared_folder(blob_url: str) -> Path | None:
    """The folder a ``file:///folder`` blob URL names, None for an ``s3://`` one; ValueError for
    any other URL."""
    parts = urlsplit(blob_url)
    if parts.scheme == "s3":
        check_s3_url(blob_url)  # the object store's own rules, without importing its client
        return None
    if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ValueError(
            f"a blob URL is file:///absolute/folder or s3://BUCKET/PREFIX?endpoint=..., not {blob_url!r}"
        )
    return Path(unquote(parts.path))
