"""``/v1/embeddings`` batch lines: what their body may hold, and the OpenAI-shaped answer.

``input`` is a non-empty string, a list of at most ``MAX_INPUTS`` non-empty strings, one token
array (a list of integers) or a list of token arrays, as OpenAI accepts. ``encoding_format`` is
``float`` (the default: lists of numbers) or ``base64`` (each vector's little-endian float32
bytes, base64-encoded, as OpenAI sends it). ``dimensions`` shortens each vector to its first
``dimensions`` values and normalises it to length 1 again (what OpenAI does for the models that
take it); a model whose backend does not declare the ``dimensions`` capability refuses the field
at upload, and one larger than the model's vectors is the request's ``invalid_request`` line.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

from msgspec import UNSET

from batchgen.core.errors import InvalidRequest
from batchgen.core.ids import new_request_id

#: OpenAI's limit on inputs per embeddings request.
MAX_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")

Inputs = tuple[str | tuple[int, ...], ...]


def _token_array(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in value)
    )


_WANTED = (
    "'body.input' must be a non-empty string, a list of non-empty strings, a token array "
    "(a list of non-negative integers) or a list of token arrays"
)


def read_inputs(value: Any) -> Inputs:
    """The inputs of an embeddings body, one text or token array each; InvalidRequest if malformed
    (the first problem ``input_problems`` finds)."""
    for problem in input_problems(value):
        raise problem
    if isinstance(value, str):
        return (value,)
    if _token_array(value):
        return (tuple(value),)
    return tuple(item if isinstance(item, str) else tuple(item) for item in value)


def input_problems(value: Any) -> Iterator[InvalidRequest]:
    """Every problem of an embeddings body's ``input``: the whole of it, or each item that is
    neither a non-empty string nor a token array, in item order."""
    if value is UNSET or value is None:
        yield InvalidRequest("missing 'body.input'", param="body.input")
        return
    if isinstance(value, str):
        if not value:
            yield InvalidRequest(_WANTED + ", got an empty string", param="body.input")
        return
    if not isinstance(value, list) or not value:
        yield InvalidRequest(_WANTED, param="body.input")
        return
    if len(value) > MAX_INPUTS:
        yield InvalidRequest(
            f"'body.input' may hold at most {MAX_INPUTS} inputs, got {len(value)}", param="body.input"
        )
        return
    if _token_array(value):
        return
    for position, item in enumerate(value):
        if not ((isinstance(item, str) and item) or _token_array(item)):
            yield InvalidRequest(
                f"'body.input[{position}]' must be a non-empty string or a token array (a list of "
                f"non-negative integers), as every item of a list 'body.input', got {_kind(item)}",
                param=f"body.input[{position}]",
            )


def _kind(item: Any) -> str:
    if isinstance(item, str):
        return "an empty string"
    if isinstance(item, list):
        return "an empty list" if not item else "a list that is not of non-negative integers"
    if item is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", dict: "a JSON object"}.get(
        type(item), type(item).__name__
    )


def check_embeddings_body(body: Any) -> None:
    """Check an ``EmbeddingsBody`` beyond its types; InvalidRequest naming the field (the first
    problem ``embeddings_body_problems`` finds)."""
    for problem in embeddings_body_problems(body):
        raise problem


def embeddings_body_problems(body: Any) -> Iterator[InvalidRequest]:
    """Every problem of an ``EmbeddingsBody`` beyond its types, in field order."""
    yield from input_problems(body.input)
    if body.encoding_format is not None and body.encoding_format not in ENCODING_FORMATS:
        yield InvalidRequest(
            f"'body.encoding_format' must be 'float' or 'base64', got {body.encoding_format!r}",
            param="body.encoding_format",
        )
    if body.dimensions is not None and body.dimensions < 1:
        yield InvalidRequest(
            f"'body.dimensions' must be at least 1, got {body.dimensions}", param="body.dimensions"
        )


def shorten(vector: Sequence[float], dimensions: int) -> tuple[float, ...]:
    """The first ``dimensions`` values of ``vector``, normalised to length 1 again."""
    head = vector[:dimensions]
    norm = math.sqrt(sum(value * value for value in head))
    return tuple(value / norm for value in head) if norm > 0 else tuple(head)


def fit_dimensions(
    vectors: Sequence[Sequence[float]], dimensions: int | None
) -> tuple[tuple[float, ...], ...]:
    """The vectors shortened to ``dimensions`` (see the module docstring); InvalidRequest when the
    model's vectors are shorter than asked."""
    if dimensions is None:
        return tuple(tuple(vector) for vector in vectors)
    fitted: list[tuple[float, ...]] = []
    for vector in vectors:
        if dimensions > len(vector):
            raise InvalidRequest(
                f"'body.dimensions' is {dimensions} but this model's embeddings have {len(vector)} "
                "dimensions; ask for that many or fewer",
                param="body.dimensions",
            )
        fitted.append(shorten(vector, dimensions) if dimensions < len(vector) else tuple(vector))
    return tuple(fitted)


def encode_base64(vector: Sequence[float]) -> str:
    """The vector as OpenAI's base64 encoding: little-endian float32 values."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_base64(text: str) -> list[float]:
    """The float32 values of a base64 embedding (for clients and tests)."""
    data = base64.b64decode(text)
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def embeddings_body(
    model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, encoding_format: str | None
) -> dict[str, Any]:
    """The OpenAI embeddings response body for one line."""
    as_base64 = encoding_format == "base64"
    return {
        "object": "list",
        "id": new_request_id("embd-"),
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": encode_base64(vector) if as_base64 else list(vector),
            }
            for index, vector in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
