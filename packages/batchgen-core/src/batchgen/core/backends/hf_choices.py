"""The transformers backend's answers in OpenAI's shapes: several choices (``n``) and logprobs.

``DecodeEngine`` generates one row per choice and records, when the line asked for them, each
generated token's log-probability and the ``k`` most likely tokens at that step (``TokenLogprob``).
This module turns the finished rows of one request into ``GenerationResult.choices``:

- chat: ``{"index", "message", "logprobs": {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]} | None, "finish_reason"}``;
- completions: ``{"index", "text", "logprobs": {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"} | None, "finish_reason"}``, ``top_logprobs`` one ``{token: logprob}`` per token
  and ``text_offset`` counted from the end of the prompt, as OpenAI counts it.

Log-probabilities are the model's own (``log_softmax`` of its raw logits), before temperature,
top-k/top-p or a structured-output mask change what is sampled, as OpenAI reports them. The
end-of-sequence token that ends a choice is not listed (it is not part of the text).
"""

from __future__ import annotations

from typing import Any

import attrs

from batchgen.core.models import COMPLETIONS, GenerationResult

#: The most choices (``n``) one line may ask for: each choice is a row of the decode batch.
MAX_CHOICES = 8


@attrs.frozen
class TokenLogprob:
    """One generated token: its id, log-probability, and the step's most likely ``(id, logprob)``."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Choice:
    """One finished row: its answer and how it ended."""

    text: str
    finish_reason: str
    completion_tokens: int
    reasoning_content: str | None = None
    #: None when the line did not ask for logprobs.
    logprobs: tuple[TokenLogprob, ...] | None = None


def logprobs_asked(endpoint: str, options: dict[str, Any]) -> int | None:
    """How many top tokens to report per step (0: only the chosen one); None: no logprobs."""
    value = options.get("logprobs")
    if value is None or value is False:
        return None
    if endpoint == COMPLETIONS:
        return int(value)
    return int(options.get("top_logprobs") or 0)


def combined_result(
    endpoint: str, prompt: str, prompt_tokens: int, choices: list[Choice], token_text: Any, keep_choices: bool
) -> GenerationResult:
    """One request's result from its choices; ``token_text(id)`` is a token's text.

    The prompt is counted once, the completion tokens of every choice together. Without
    ``keep_choices`` (one choice, no logprobs) the output line is made from ``text`` as always."""
    first = choices[0]
    shaped = None
    if keep_choices:
        shape = _completion_choice if endpoint == COMPLETIONS else _chat_choice
        shaped = tuple(shape(index, choice, token_text, prompt) for index, choice in enumerate(choices))
    return GenerationResult(
        text=first.text,
        finish_reason=first.finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(choice.completion_tokens for choice in choices),
        reasoning_content=first.reasoning_content,
        choices=shaped,
    )


def _entry(token: int, logprob: float, token_text: Any) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_choice(index: int, choice: Choice, token_text: Any, prompt: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.reasoning_content is not None:
        message["reasoning_content"] = choice.reasoning_content
    logprobs = None
    if choice.logprobs is not None:
        content = []
        for step in choice.logprobs:
            entry = _entry(step.token, step.logprob, token_text)
            entry["top_logprobs"] = [_entry(token, logprob, token_text) for token, logprob in step.top]
            content.append(entry)
        logprobs = {"content": content}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": choice.finish_reason}


def _completion_choice(index: int, choice: Choice, token_text: Any, prompt: str) -> dict[str, Any]:
    logprobs = None
    if choice.logprobs is not None:
        tokens = [token_text(step.token) for step in choice.logprobs]
        offsets, offset = [], len(prompt)
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [step.logprob for step in choice.logprobs],
            "top_logprobs": [
                {token_text(token): logprob for token, logprob in step.top} for step in choice.logprobs
            ],
            "text_offset": offsets,
        }
    return {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
