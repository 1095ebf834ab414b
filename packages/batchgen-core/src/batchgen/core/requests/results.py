"""The lines of a batch's output and error files, built from a backend's result or an error.

Output lines follow the OpenAI batch output format: ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}`` with a ``chat.completion``,
``text_completion``, embeddings ``list`` (``embeddings_api``) or ``response`` (``responses_api``)
body. Error lines carry ``"response": null`` and ``{"code", "message"}``.

Every chat and completions body's ``usage`` has ``prompt_tokens_details.cached_tokens`` (a
Responses body's ``input_tokens_details.cached_tokens``): the prompt tokens the engine's prefix
cache served, as the backend reports them, and 0 when it does not say, as OpenAI always writes
the field; on a line the result cache replays, all its prompt tokens (``replayed_body``).

Every line is exactly one line to any reader: JSON escapes the ASCII control characters, and the
three other characters Python's ``str.splitlines`` breaks at (U+0085, U+2028, U+2029), which
JSON allows raw, are written as ``\\u`` escapes too (``_one_line``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from batchgen.core.ids import new_request_id
from batchgen.core.models import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES, GenerationResult
from batchgen.core.requests.embeddings_api import embeddings_body
from batchgen.core.requests.responses_api import response_body, responses_terms

_encode_json = msgspec.json.Encoder().encode
#: UTF-8 of the line breaks JSON leaves raw, and their JSON escapes. In valid UTF-8 these byte
#: sequences only ever encode those characters, so a byte replace is exact.
_RAW_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _one_line(value: Any) -> bytes:
    """``value`` as JSON on one line, ending in a newline, with no raw Unicode line break inside."""
    data = _encode_json(value)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _RAW_BREAKS:
            data = data.replace(raw, escaped)
    return data + b"\n"


def _response_body(
    endpoint: str, model: str, result: GenerationResult, created: int, body: Any
) -> dict[str, Any]:
    if endpoint == EMBEDDINGS:
        vectors = result.embeddings or ()
        return embeddings_body(model, vectors, result.prompt_tokens, getattr(body, "encoding_format", None))
    if endpoint == RESPONSES:
        return response_body(model, result, created, body)
    usage = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.reported_cached_tokens},  # last: see replayed_body
    }
    if endpoint == CHAT_COMPLETIONS:
        message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
        if result.reasoning_content is not None:
            message["reasoning_content"] = result.reasoning_content
        return {
            "id": new_request_id("chatcmpl-"),
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [_with_refusal(choice) for choice in result.choices]
            if result.choices is not None
            else [{"index": 0, "message": message, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage,
        }
    return {
        "id": new_request_id("cmpl-"),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": list(result.choices)
        if result.choices is not None
        else [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": usage,
    }


def _with_refusal(choice: dict[str, Any]) -> dict[str, Any]:
    """A backend's chat choice with the ``refusal`` fields OpenAI's schema requires where the
    backend left them out (null: no model here refuses): ``message.refusal``, and
    ``logprobs.refusal`` beside the ``logprobs.content`` of the answer's tokens."""
    message, logprobs = choice.get("message"), choice.get("logprobs")
    if isinstance(message, dict) and "refusal" not in message:
        choice = {**choice, "message": {**message, "refusal": None}}
    if isinstance(logprobs, dict) and "refusal" not in logprobs:
        choice = {**choice, "logprobs": {**logprobs, "refusal": None}}
    return choice


def output_line(
    custom_id: str,
    request_id: str,
    endpoint: str,
    model: str,
    result: GenerationResult,
    created: int,
    body: Any = None,
) -> bytes:
    """The output line of a finished request; ``body`` is the line's decoded body (the embeddings
    ``encoding_format``, the Responses fields echoed back)."""
    line = {
        "id": new_request_id("batch_req_"),
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": request_id,
            "body": _response_body(endpoint, model, result, created, body),
        },
        "error": None,
    }
    return _one_line(line)


def response_body_json(
    endpoint: str, model: str, result: GenerationResult, created: int, body: Any = None
) -> bytes:
    """A finished request's ``response.body`` as the JSON bytes an output line holds (what the
    result cache keeps, ``result_cache``)."""
    return _one_line(_response_body(endpoint, model, result, created, body))[:-1]


def line_cached_tokens(endpoint: str, result: GenerationResult) -> int:
    """The ``cached_tokens`` a result's output line reports (what the counters add up): the
    engine's figure, 0 when it does not say; an embeddings line has no such field, so 0."""
    return 0 if endpoint == EMBEDDINGS else result.reported_cached_tokens


#: How a chat or completions body built here ends: its usage's details, the last member.
_DETAILS_TAIL = b',"prompt_tokens_details":{"cached_tokens":'


def replayed_body(endpoint: str, body_json: bytes, prompt_tokens: int) -> bytes:
    """A result cache entry's body as a replayed line holds it: the first run's, byte for byte,
    but for its usage's ``cached_tokens``, which is ``prompt_tokens`` (none of the prompt was
    computed again). Embeddings bodies have no such field and are kept whole.

    Bodies built here end with ``…,"prompt_tokens_details":{"cached_tokens":N}}}``, and only the
    number is replaced. Any other body (a ``/v1/responses`` one, or an entry stored by an older
    version, with no details) is decoded, given the field and encoded again."""
    if endpoint == EMBEDDINGS:
        return body_json
    cached = str(prompt_tokens).encode()
    start = body_json.rfind(_DETAILS_TAIL)
    if start >= 0 and body_json.endswith(b"}}}"):
        number = body_json[start + len(_DETAILS_TAIL) : -3]
        if number.isdigit():
            return body_json[: start + len(_DETAILS_TAIL)] + cached + b"}}}"
    body = msgspec.json.decode(body_json)
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return body_json
    key = "input_tokens_details" if endpoint == RESPONSES else "prompt_tokens_details"
    details = usage.get(key)
    usage[key] = (
        {**details, "cached_tokens": prompt_tokens}
        if isinstance(details, dict)
        else {"cached_tokens": prompt_tokens}
    )
    return _one_line(body)[:-1]


def body_output_line(custom_id: str, request_id: str, body_json: bytes, *, cached: bool = False) -> bytes:
    """An output line around a response body given as JSON bytes, which it holds byte for byte;
    ``cached``: the body was replayed from the result cache (the line says ``"cached": true``)."""
    line: dict[str, Any] = {
        "id": new_request_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": msgspec.Raw(body_json)},
        "error": None,
    }
    if cached:
        line["cached"] = True
    return _one_line(line)


def error_line(custom_id: str, code: str, message: str, endpoint: str | None = None) -> bytes:
    """The error line of a request that failed; a ``/v1/responses`` request's message names the
    Responses fields (``body.max_output_tokens``), not the chat ones it ran through."""
    if endpoint == RESPONSES:
        message = responses_terms(message)
    line = {
        "id": new_request_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return _one_line(line)
