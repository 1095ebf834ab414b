"""S3 locations: an ``s3://BUCKET/PREFIX?endpoint=...&region=...`` URL made into an obstore client.

``check_s3_url(url)`` checks a URL without importing the client; ``open_s3_store(url)`` checks it
and gives an ``S3Store`` rooted at the URL's prefix, with
bounded retries and timeouts, and a description for logs and reprs. ``endpoint`` names a store
other than AWS (``http://`` is allowed for one on a private network), ``region`` defaults to
``us-east-1``; the credentials come from ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (and
``AWS_SESSION_TOKEN``), never from the URL, so they stay out of logs and process lists.

obstore (Rust's ``object_store`` under Python) is the client because it does what the replicas
need of a store: conditional puts (``If-None-Match: *``, so a key written once never changes),
ranged gets, streamed multipart uploads from a file, and AWS, SeaweedFS and MinIO signing. Its
calls are synchronous here; callers run them in worker threads, off the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from obstore.store import S3Config, S3Store

__all__ = ["MAX_S3_URL", "RETRY_TIMEOUT", "check_s3_url", "open_s3_store"]

#: A failed request is retried for at most this long before the call fails (and its caller reports
#: itself unhealthy and tries again later): long enough to ride out a blip, short enough that an
#: outage shows at once and a shard's owner keeps well within its lease.
RETRY_TIMEOUT = timedelta(seconds=3)
#: The longest ``s3://`` URL accepted.
MAX_S3_URL = 2048
_QUERY_KEYS = frozenset({"endpoint", "region"})


def check_s3_url(url: str) -> None:
    """ValueError saying what is wrong with ``url`` if it is not an ``s3://`` URL the store
    would take; nothing is imported or connected."""
    _parse(url)


def open_s3_store(url: str, environ: Mapping[str, str] | None = None) -> tuple[S3Store, str]:
    """The store an ``s3://`` URL names, rooted at its prefix, and its description
    (``s3://bucket/prefix``); ValueError saying what is wrong with any other URL. Credentials
    come from ``environ`` (by default the process's environment)."""
    environ = os.environ if environ is None else environ
    bucket, prefix, config, allow_http = _parse(url)
    if environ.get("AWS_ACCESS_KEY_ID"):
        config["access_key_id"] = environ["AWS_ACCESS_KEY_ID"]
    if environ.get("AWS_SECRET_ACCESS_KEY"):
        config["secret_access_key"] = environ["AWS_SECRET_ACCESS_KEY"]
    if environ.get("AWS_SESSION_TOKEN"):
        config["session_token"] = environ["AWS_SESSION_TOKEN"]
    from obstore.store import S3Store  # the s3 extra, imported only when an s3:// URL is given

    store = S3Store(
        bucket,
        prefix=prefix,
        config=config,
        retry_config={"max_retries": 3, "retry_timeout": RETRY_TIMEOUT},
        client_options={
            "allow_http": allow_http,
            "timeout": timedelta(seconds=30),
            "connect_timeout": timedelta(seconds=5),
        },
    )
    return store, f"s3://{bucket}/{prefix or ''}"


def _parse(url: str) -> tuple[str, str | None, S3Config, bool]:
    """The bucket, the prefix, the client settings and whether plain ``http://`` is allowed."""
    if len(url) > MAX_S3_URL:
        raise ValueError(f"an s3:// URL is at most {MAX_S3_URL} characters")
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.hostname:
        raise ValueError(f"not an s3://BUCKET/PREFIX URL: {url!r}")
    if parts.username or parts.password:
        raise ValueError("put the credentials in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, not the URL")
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
    return parts.hostname, parts.path.strip("/") or None, config, allow_http
