"""What the vLLM backend sends and reads: OpenAI request fields as vLLM ``SamplingParams``
keyword arguments, and vLLM's ``RequestOutput`` as a ``GenerationResult``.

Nothing here imports vLLM; the engine module builds ``SamplingParams(**sampling_kwargs(...))``.

Sampling. ``max_tokens`` is the limit left after the prompt (vLLM refuses a prompt plus limit
longer than the context); temperature, ``top_p``, ``seed`` and ``stop`` carry over by name;
OpenAI's ``top_k`` -1 ("off") is vLLM's 0. ``n``, ``logprobs``/``top_logprobs``, the penalties,
``logit_bias`` (token ids as JSON object keys) and ``response_format`` (vLLM's own structured
output: ``StructuredOutputsParams(json=schema)``, the schema checked against the same bounds as
the transformers backend's grammar) are passed only where the line set them. vLLM refuses ``n``
above 1 for greedy sampling, whose choices are all the same answer: one is run, and repeated. Stop strings are
left out of the text, as OpenAI leaves them out.

Results. Each ``CompletionOutput`` is one choice; vLLM's log-probabilities are the model's raw
ones (before temperature and the other processors), the chosen token's and the ``k`` most likely
at each step, which is what OpenAI reports. The prompt is counted once, the completion tokens of
all choices together; ``num_cached_tokens`` (the prompt tokens vLLM's prefix cache served) is
the result's ``cached_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from batchgen.core.backends.base import RequestRejected, TransientBackendError
from batchgen.core.backends.cached_tokens import bounded_cached_tokens
from batchgen.core.backends.hf_choices import Choice, TokenLogprob, combined_result, logprobs_asked
from batchgen.core.backends.text import split_reasoning
from batchgen.core.models import GenerationRequest, GenerationResult

#: The most choices (``n``) one line may ask for, as in the transformers backend.
MAX_CHOICES = 8
#: vLLM's finish reasons that end a request normally, as OpenAI names them.
_FINISHED = {"stop": "stop", "length": "length"}


def choices_asked(options: Mapping[str, Any]) -> int:
    """The line's ``n`` (1 when it did not set one)."""
    value = options.get("n")
    return int(value) if isinstance(value, int) and value > 0 else 1


def logit_bias_of(options: Mapping[str, Any], vocabulary: int | None) -> dict[int, float] | None:
    """``logit_bias`` with token-id keys, each a token of the model; None when the line set none."""
    bias = options.get("logit_bias")
    if not bias:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key)
        if token < 0 or (vocabulary is not None and token >= vocabulary):
            raise RequestRejected(
                "invalid_request", f"logit_bias names token {token}, which this model does not have"
            )
        parsed[token] = float(value)
    return parsed


def sampling_kwargs(
    request: GenerationRequest,
    max_tokens: int,
    *,
    schema_text: str | None = None,
    vocabulary: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` for ``request``, with ``max_tokens`` the
    limit the context leaves and ``schema_text`` the checked JSON schema of its ``response_format``
    (the engine module wraps it in ``StructuredOutputsParams``)."""
    sampling, options = request.sampling, request.options
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,
        # vLLM refuses n > 1 when greedy; every greedy choice is the same, so one is run (result_of
        # repeats it as the n choices the line asked for)
        "n": 1 if sampling.greedy else choices_asked(options),
    }
    if sampling.seed is not None:
        kwargs["seed"] = sampling.seed
    if sampling.stop:
        kwargs["stop"] = list(sampling.stop)
    top = logprobs_asked(request.endpoint, options)
    if top is not None:
        kwargs["logprobs"] = top
    for penalty in ("frequency_penalty", "presence_penalty"):
        if options.get(penalty):
            kwargs[penalty] = float(options[penalty])
    bias = logit_bias_of(options, vocabulary)
    if bias is not None:
        kwargs["logit_bias"] = bias
    if schema_text is not None:
        kwargs["structured_json"] = schema_text
    return kwargs


def _step(token: int, entries: Mapping[int, Any] | None, top: int, names: dict[int, str]) -> TokenLogprob:
    """One generated token's log-probability and the ``top`` most likely tokens at its step.

    vLLM lists the ``top`` most likely tokens and the chosen one, once: ``top`` + 1 entries when
    the chosen token is not among the most likely, else ``top``."""
    entries = entries or {}
    for candidate, entry in entries.items():
        decoded = getattr(entry, "decoded_token", None)
        if decoded is not None:
            names.setdefault(candidate, decoded)
    chosen = entries.get(token)
    ranked = [
        (candidate, entry)
        for candidate, entry in entries.items()
        if not (candidate == token and len(entries) > top)  # the chosen one, listed beside the top
    ]
    ranked.sort(key=lambda item: (-float(item[1].logprob), getattr(item[1], "rank", 0) or 0))
    return TokenLogprob(
        token=token,
        logprob=float(chosen.logprob) if chosen is not None else float("-inf"),
        top=tuple((candidate, float(entry.logprob)) for candidate, entry in ranked[:top]),
    )


def result_of(
    request: GenerationRequest,
    output: Any,
    *,
    prompt_text: str,
    opens_reasoning: bool,
    token_text: Any,
) -> GenerationResult:
    """The result of a finished vLLM ``RequestOutput``; ``token_text(id)`` names a token that
    vLLM's log-probabilities did not decode. An abort by the engine is a ``TransientBackendError``
    (the engine module turns an abort that was asked for into ``RequestAborted`` first)."""
    completions: Sequence[Any] = sorted(output.outputs, key=lambda completion: completion.index)
    if not completions:
        raise TransientBackendError("vLLM returned no output for the request")
    asked = choices_asked(request.options)
    if request.sampling.greedy and len(completions) == 1 < asked:
        completions = [completions[0]] * asked  # greedy: each of the n choices is the same answer
    top = logprobs_asked(request.endpoint, request.options)
    names: dict[int, str] = {}
    choices: list[Choice] = []
    for completion in completions:
        finish = _FINISHED.get(str(completion.finish_reason))
        if finish is None:
            raise TransientBackendError(f"vLLM ended the request with {completion.finish_reason!r}")
        text, reasoning = split_reasoning(completion.text or "", opened_by_prompt=opens_reasoning)
        steps = None
        if top is not None:
            logprobs = completion.logprobs or [None] * len(completion.token_ids)
            steps = tuple(
                _step(token, entries, top, names)
                for token, entries in zip(completion.token_ids, logprobs, strict=False)
            )
        choices.append(Choice(text, finish, len(completion.token_ids), reasoning, steps))
    prompt_ids = output.prompt_token_ids or ()
    result = combined_result(
        request.endpoint,
        prompt_text,
        len(prompt_ids),
        choices,
        lambda token: names[token] if token in names else token_text(token),
        keep_choices=len(choices) > 1 or top is not None,
    )
    cached = bounded_cached_tokens(getattr(output, "num_cached_tokens", None), len(prompt_ids))
    return attrs.evolve(result, cached_tokens=cached)
