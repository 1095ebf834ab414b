"""Conditional GETs for the objects clients poll: an ``ETag`` on the answer, ``304`` when it matches.

A client polling ``GET /v1/batches/{id}`` or ``GET /v1/pool/status`` faster than the object changes
may send back the ``ETag`` of its last answer in ``If-None-Match``; while the object is the same
the server answers ``304 Not Modified`` with no body. The tag is a hash of the JSON body, so it
changes exactly when the answer would. Clients that send no ``If-None-Match`` (the ``openai`` SDK)
get the usual ``200`` with the body. The server never delays an answer.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.status_codes import HTTP_200_OK, HTTP_304_NOT_MODIFIED

_HEADERS = {"Cache-Control": "no-cache"}  # a cache may keep it, but must ask again before using it


def entity_tag(body: bytes) -> str:
    """A strong entity tag for ``body``."""
    return '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'


def matches(if_none_match: str | None, tag: str) -> bool:
    """Whether an ``If-None-Match`` header names ``tag`` (weak comparison, as RFC 9110 says for GET)."""
    if not if_none_match:
        return False
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == tag:
            return True
    return False


def json_with_etag(request: Request[Any, Any, Any], payload: dict[str, Any]) -> Response[Any]:
    """``payload`` as JSON with its ``ETag``, or an empty ``304`` when the client already has it.
    The JSON the tag is made from is the body sent: it is encoded once."""
    body = msgspec.json.encode(payload)
    tag = entity_tag(body)
    headers = {**_HEADERS, "ETag": tag}
    if matches(request.headers.get("if-none-match"), tag):
        return Response(None, status_code=HTTP_304_NOT_MODIFIED, headers=headers)
    return Response(body, status_code=HTTP_200_OK, headers=headers, media_type=MediaType.JSON)
