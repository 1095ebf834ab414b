"""The text rules every backend applies the same way: message content, stop strings, reasoning.

``flatten_content``  OpenAI message content (a string, or a list of content parts) as one string
``text_messages``    chat messages with their content as strings, as chat templates expect
``trim_at_stop``     text cut before the first stop string it contains (OpenAI never returns one)
``split_reasoning``  a ``<think>…</think>`` block at the start of an answer, apart from the answer

Backends call these instead of writing their own, so a request gets the same text whichever
backend runs it. Nothing here knows about any engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from batchgen.core.backends.base import RequestRejected

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def flatten_content(content: object, *, backend: str) -> str:
    """One string for a message's ``content``: text parts joined by newlines; None is "".

    A part that is not text (an image, audio, ...) raises ``RequestRejected("invalid_request")``
    naming ``backend``: BatchGen's backends are text only.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestRejected(
            "invalid_request",
            f"Message content must be a string or a list of content parts, not {type(content).__name__}.",
        )
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestRejected(
                "invalid_request", f"The {backend} backend takes text content only, not {kind!r} parts."
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def text_messages(messages: Iterable[Mapping[str, Any]], *, backend: str) -> list[dict[str, Any]]:
    """The messages with their content as one string each (``flatten_content``), every other
    field kept: list content flattened, and null or missing content (an assistant message that
    only calls tools) as "", since chat templates concatenate the content as a string."""
    result = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            result.append(dict(message))
        else:
            result.append({**message, "content": flatten_content(content, backend=backend)})
    return result


def rendered_chat(tokenizer: Any, messages: Iterable[Mapping[str, Any]], *, backend: str) -> str:
    """The prompt the model's chat template makes of ``messages`` (ending in the assistant's turn);
    a template that cannot render them is the line's ``invalid_request`` error."""
    try:
        return str(
            tokenizer.apply_chat_template(
                text_messages(messages, backend=backend), tokenize=False, add_generation_prompt=True
            )
        )
    except RequestRejected:
        raise
    except Exception as exc:
        raise RequestRejected(
            "invalid_request", f"The model's chat template cannot render these messages: {exc}"
        ) from exc


def trim_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the earliest occurrence of any non-empty stop string, and whether one occurred."""
    cuts = [index for index in (text.find(stop) for stop in stops if stop) if index != -1]
    if not cuts:
        return text, False
    return text[: min(cuts)], True


def split_reasoning(text: str, *, opened_by_prompt: bool = False) -> tuple[str, str | None]:
    """The answer and the reasoning of a ``<think>…</think>`` block at the start of ``text``.

    Returns ``(text, None)`` when there is no such block. ``opened_by_prompt``: the chat template
    already wrote ``<think>``, so the output starts inside the block. As in SGLang's reasoning
    parser, a block that never closes (the output limit cut it off) is all reasoning.
    """
    body = text
    if not opened_by_prompt:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return text, None
        body = stripped[len(THINK_OPEN) :]
    reasoning, closed, answer = body.partition(THINK_CLOSE)
    if not closed:
        return "", body.strip()
    return answer.lstrip(), reasoning.strip()


def prompt_opens_reasoning(rendered_prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside an opened ``<think>`` block (Qwen3 style)."""
    return rendered_prompt.rstrip().endswith(THINK_OPEN)
