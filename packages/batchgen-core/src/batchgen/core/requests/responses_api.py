"""``/v1/responses`` batch lines: what BatchGen runs of the Responses API, and the answer's shape.

A line's ``input`` (a string, or a list of message items) and ``instructions`` become chat
messages (``chat_messages``) and run on the chat path of the chosen model; the answer is a
``response`` object (``response_body``) with one ``message`` output item holding an
``output_text`` part, the top-level ``output_text`` convenience the SDKs offer, and ``usage`` in
input/output tokens (``input_tokens_details.cached_tokens``: what the engine's prefix cache served).

Refused at upload, naming the line and every problem of it (``responses_body_problems``): tools and tool choices, hosted
state (``previous_response_id``, ``conversation``, ``store: true``), ``background``,
``include``, reusable ``prompt`` templates, streaming, and input items other than messages with
text (images, files, function calls). ``text.format`` (structured output) and ``top_logprobs``
run where the model's backend supports them, as for chat lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from msgspec import UNSET

from batchgen.core.errors import InvalidRequest
from batchgen.core.ids import new_request_id
from batchgen.core.models import GenerationResult
from batchgen.core.requests.structured_output import from_responses_text, response_format_problem

#: Fields whose features BatchGen does not run, and why, in the words of the 400.
UNSUPPORTED_FIELDS = {
    "tools": "tools are not supported in batches",
    "tool_choice": "tools are not supported in batches",
    "previous_response_id": "responses are not stored, so there is no previous response to continue",
    "conversation": "conversations are not stored",
    "background": "batch lines already run in the background",
    "include": "no extra output (include) is available",
    "prompt": "reusable prompt templates are not available; send 'input' and 'instructions'",
    "reasoning": "reasoning options are not supported",
}
#: Chat fields a Responses body may not use, each with the Responses field that says the same.
CHAT_ONLY_FIELDS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
#: How messages about the chat fields a Responses line runs through name them: by the
#: Responses field the user set (``responses_terms``).
_RESPONSES_NAMES = (
    ("'body.max_completion_tokens'", "'body.max_output_tokens'"),
    ("'body.response_format'", "'body.text.format'"),
    ("'body.logprobs':", "'body.top_logprobs':"),  # the capability check's "'field': model ..."
    ("'body.messages'", "'body.input'"),
)
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _refusal(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"'body.{field}' is not supported for /v1/responses in BatchGen: {why}", param=f"body.{field}"
    )


def responses_terms(message: str) -> str:
    """``message`` about a Responses line, with the chat fields it runs through (which the checks
    and backends name) named as the Responses fields they come from."""
    if "'body." not in message:
        return message
    for chat, responses in _RESPONSES_NAMES:
        message = message.replace(chat, responses)
    return message


def check_responses_body(body: Any) -> None:
    """Refuse what BatchGen does not run, and check ``input``; InvalidRequest naming the field (the
    first problem ``responses_body_problems`` finds)."""
    for problem in responses_body_problems(body):
        raise problem


def responses_body_problems(body: Any) -> Iterator[InvalidRequest]:
    """Every problem of a ``ResponsesBody`` beyond its types, in the order of the checks: each chat
    field it may not use, each feature BatchGen does not run, each input item that cannot be mapped,
    ``text``. Once they are all found, the body is made ready for the chat path: ``text.format``
    becomes ``response_format`` and ``max_output_tokens`` the chat output limit; a chat field it
    reported is cleared, so no later check names it again."""
    reported: list[str] = []
    for field, instead in CHAT_ONLY_FIELDS.items():
        if getattr(body, field) is not None:
            reported.append(field)
            yield InvalidRequest(
                f"'body.{field}' is a /v1/chat/completions field; a /v1/responses body sets "
                f"'{instead}' instead",
                param=f"body.{field}",
            )
    for field, why in UNSUPPORTED_FIELDS.items():
        value = getattr(body, field, None)
        if value in (None, [], {}, False) or (field == "tool_choice" and value == "none"):
            continue
        yield _refusal(field, why)
    if body.store is True:
        yield _refusal("store", "responses are not stored; set 'store': false or leave it out")
    if body.logprobs is not None:
        yield InvalidRequest(
            "'body.logprobs' is not a /v1/responses field; use 'top_logprobs'", param="body.logprobs"
        )
    yield from _messages_and_problems(body.instructions, body.input)[1]
    format_ok = True
    if body.text is not None and not isinstance(body.text, dict):
        format_ok = False
        yield InvalidRequest("'body.text' must be an object such as {\"format\": {...}}", param="body.text")
    elif (
        isinstance(body.text, dict)
        and body.text.get("format") is not None
        and not isinstance(body.text["format"], dict)
    ):
        format_ok = False
        yield InvalidRequest(
            "'body.text.format' must be an object with a 'type' (text, json_object or json_schema)",
            param="body.text.format",
        )
    response_format = from_responses_text(body.text) if format_ok else None
    if response_format is not None:
        problem = response_format_problem(response_format)
        if problem is not None:
            response_format = None
            yield InvalidRequest(f"'body.text.format' {problem}", param="body.text.format")
    for field in reported:
        setattr(body, field, None)
    if response_format is not None:
        body.response_format = response_format  # the chat field the backends read
    if body.max_output_tokens is not None:
        body.max_completion_tokens = body.max_output_tokens  # the output limit of the chat path


def _text_problems(content: Any, position: int) -> tuple[str, list[InvalidRequest]]:
    """The text of an input item's ``content``, and every problem of it (each part not text)."""
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts: list[str] = []
        problems: list[InvalidRequest] = []
        for part_position, part in enumerate(content):
            if (
                isinstance(part, dict)
                and part.get("type") in _TEXT_PARTS
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
                continue
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            problems.append(
                InvalidRequest(
                    f"'body.input[{position}].content[{part_position}]' is a {kind!r} part; only text "
                    "parts (input_text, output_text) are supported",
                    param=f"body.input[{position}].content",
                )
            )
        return "".join(texts), problems
    problem = InvalidRequest(
        f"'body.input[{position}].content' must be a string or a list of text parts",
        param=f"body.input[{position}].content",
    )
    return "", [problem]


def chat_messages(instructions: str | None, input_value: Any) -> tuple[dict[str, Any], ...]:
    """The chat messages a Responses line runs as; InvalidRequest naming what cannot be mapped
    (the first problem)."""
    messages, problems = _messages_and_problems(instructions, input_value)
    if problems:
        raise problems[0]
    return messages


def _messages_and_problems(
    instructions: str | None, input_value: Any
) -> tuple[tuple[dict[str, Any], ...], list[InvalidRequest]]:
    """The chat messages a Responses line runs as, and every problem of its ``input`` (each item
    that is not a message, each bad role, each part that is not text), in item order."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if input_value is UNSET or input_value is None:
        return (), [InvalidRequest("missing 'body.input'", param="body.input")]
    if isinstance(input_value, str):
        if not input_value:
            return (), [InvalidRequest("'body.input' must not be empty", param="body.input")]
        messages.append({"role": "user", "content": input_value})
        return tuple(messages), []
    if not isinstance(input_value, list) or not input_value:
        problem = InvalidRequest(
            "'body.input' must be a string or a non-empty list of message items", param="body.input"
        )
        return (), [problem]
    problems: list[InvalidRequest] = []
    for position, item in enumerate(input_value):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            problems.append(
                InvalidRequest(
                    f"'body.input[{position}]' is a {kind!r} item; only message items "
                    '({"role", "content"}) are supported',
                    param=f"body.input[{position}]",
                )
            )
            continue
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            problems.append(
                InvalidRequest(
                    f"'body.input[{position}].role' must be user, system, developer or assistant, "
                    f"got {item.get('role')!r}",
                    param=f"body.input[{position}].role",
                )
            )
        text, text_problems = _text_problems(item.get("content"), position)
        problems.extend(text_problems)
        if role is not None:
            messages.append({"role": role, "content": text})
    return tuple(messages), problems


def _token_logprobs(result: GenerationResult) -> list[dict[str, Any]]:
    """The ``output_text`` part's ``logprobs`` (OpenAI's schema requires the list): the tokens of
    the chat answer's first choice with their logprobs when ``top_logprobs`` asked for them, in
    the same ``{"token", "logprob", "bytes", "top_logprobs"}`` shape; else none."""
    if not result.choices:
        return []
    logprobs = result.choices[0].get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return list(content) if isinstance(content, list) else []


def response_body(model: str, result: GenerationResult, created: int, body: Any) -> dict[str, Any]:
    """The Responses API ``response`` object for one finished line."""
    incomplete = result.finish_reason == "length"
    text_part: dict[str, Any] = {
        "type": "output_text",
        "text": result.text,
        "annotations": [],
        "logprobs": _token_logprobs(result),
    }
    return {
        "id": new_request_id("resp_"),
        "object": "response",
        "created_at": created,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "output": [
            {
                "id": new_request_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "incomplete" if incomplete else "completed",
                "content": [text_part],
            }
        ],
        "output_text": result.text,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "store": False,
        "metadata": {},
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.reported_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    }
