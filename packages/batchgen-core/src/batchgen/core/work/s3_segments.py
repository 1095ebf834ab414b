"""S3Segments: output segments as objects in any S3-compatible store (``s3://BUCKET/PREFIX?...``).

The keys and the rules are ``segment_store``'s; here a key is an object under the URL's prefix.
A segment is written with one conditional ``PutObject`` (``If-None-Match: *``): the store refuses
a second write of a key (412), so committed bytes never change, and a put that returned is
durable. Reads are ranged ``GET``s of committed sizes only; orphans are found by listing.

obstore (Rust's ``object_store`` under Python) is the client: it does conditional puts and ranged
gets, signs for AWS, SeaweedFS, MinIO and the rest, and retries transient failures itself. Its
calls here are the synchronous ones; the shard runner calls ``write`` in a worker thread, so the
event loop never waits on the network.

``S3Segments.from_url("s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1")``:
``endpoint`` for a store other than AWS (``http://`` allowed), ``region`` (default ``us-east-1``);
credentials from the usual ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (and
``AWS_SESSION_TOKEN``) variables, never from the URL, so they stay out of logs and process lists.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import S3Store

from batchgen.core.work.segment_store import SEGMENTS_PREFIX, SegmentMissing, SegmentStore
from batchgen.core.work.shards import Segment

if TYPE_CHECKING:
    from obstore.store import S3Config

__all__ = ["S3Segments"]

#: A failed request is retried for at most this long before the call fails (and the shard runner
#: reports itself unhealthy, keeps the lines and tries again): long enough to ride out a blip,
#: short enough that an outage shows at once and a shard's owner keeps well within its lease.
RETRY_TIMEOUT = timedelta(seconds=3)
_QUERY_KEYS = frozenset({"endpoint", "region"})
_MAX_URL = 2048


class S3Segments(SegmentStore):
    """Segments under ``prefix`` in ``bucket``."""

    def __init__(self, store: S3Store, description: str) -> None:
        self._store = store
        self._description = description

    def __repr__(self) -> str:
        return f"S3Segments({self._description!r})"

    @classmethod
    def from_url(cls, url: str, environ: dict[str, str] | None = None) -> S3Segments:
        """The store an ``s3://`` URL names (see the module's docstring); ValueError saying what
        is wrong with any other."""
        environ = dict(os.environ) if environ is None else environ
        if len(url) > _MAX_URL:
            raise ValueError(f"an s3:// URL is at most {_MAX_URL} characters")
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.hostname:
            raise ValueError(f"not an s3://BUCKET/PREFIX URL: {url!r}")
        if parts.username or parts.password:
            raise ValueError(
                "put the credentials in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, not the URL"
            )
        query = parse_qs(parts.query, strict_parsing=False)
        unknown = set(query) - _QUERY_KEYS
        if unknown:
            raise ValueError(
                f"unknown s3:// URL parameters: {', '.join(sorted(unknown))} (known: endpoint, region)"
            )
        config: S3Config = {"region": query.get("region", ["us-east-1"])[-1]}
        endpoint = query.get("endpoint", [None])[-1]
        allow_http = False
        if endpoint is not None:
            scheme = urlsplit(endpoint).scheme
            if scheme not in ("http", "https"):
                raise ValueError(f"the endpoint must be an http:// or https:// URL, not {endpoint!r}")
            config["endpoint"] = endpoint
            allow_http = scheme == "http"
            config["virtual_hosted_style_request"] = False
        if environ.get("AWS_ACCESS_KEY_ID"):
            config["access_key_id"] = environ["AWS_ACCESS_KEY_ID"]
        if environ.get("AWS_SECRET_ACCESS_KEY"):
            config["secret_access_key"] = environ["AWS_SECRET_ACCESS_KEY"]
        if environ.get("AWS_SESSION_TOKEN"):
            config["session_token"] = environ["AWS_SESSION_TOKEN"]
        prefix = parts.path.strip("/") or None
        store = S3Store(
            parts.hostname,
            prefix=prefix,
            config=config,
            retry_config={"max_retries": 3, "retry_timeout": RETRY_TIMEOUT},
            client_options={
                "allow_http": allow_http,
                "timeout": timedelta(seconds=30),
                "connect_timeout": timedelta(seconds=5),
            },
        )
        return cls(store, f"s3://{parts.hostname}/{prefix or ''}")

    def write(self, key: str, data: bytes) -> int:
        _check(key)
        try:
            obstore.put(self._store, key, data, mode="create")
        except AlreadyExistsError as exists:
            raise FileExistsError(f"segment {key} exists already") from exists
        return len(data)

    def _read_part(self, segment: Segment, start: int, end: int) -> Iterator[bytes]:
        _check(segment.object_key)
        try:
            data = bytes(obstore.get_range(self._store, segment.object_key, start=start, end=end))
        except (NotFoundError, FileNotFoundError) as missing:
            raise SegmentMissing(f"committed segment {segment.object_key} is missing") from missing
        if len(data) != end - start:
            raise SegmentMissing(f"{segment.object_key} is shorter than its committed {segment.size} bytes")
        yield data

    def _listing(self) -> Iterator[tuple[str, float]]:
        for chunk in obstore.list(self._store, prefix=SEGMENTS_PREFIX.rstrip("/")):
            for meta in chunk:
                yield meta["path"], meta["last_modified"].timestamp()

    def _delete(self, key: str) -> bool:
        _check(key)
        try:
            obstore.delete(self._store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        return True


def _check(key: str) -> None:
    if not key.startswith(SEGMENTS_PREFIX) or ".." in key.split("/"):
        raise ValueError(f"segment key {key!r} is outside the segments prefix")
