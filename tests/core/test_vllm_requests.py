"""What the vLLM backend sends and reads (``backends.vllm_requests``), without vLLM: OpenAI fields
as ``SamplingParams`` keyword arguments for any resolved parameters, and vLLM's output shapes
(``RequestOutput``/``CompletionOutput``/``Logprob``, built here with their documented attributes)
as results. The real engine is driven by the contract suite (tests/core/test_backend_contract.py).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends.base import RequestRejected, TransientBackendError
from batchgen.core.backends.vllm_requests import result_of, sampling_kwargs
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, GenerationRequest, SamplingParameters

VOCABULARY = 1000

samplings = st.builds(
    SamplingParameters,
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.one_of(st.just(-1), st.integers(1, 100)),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=4).map(tuple),
)


@st.composite
def options(draw: st.DrawFn, endpoint: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if draw(st.booleans()):
        found["n"] = draw(st.integers(1, 8))
    if endpoint == COMPLETIONS and draw(st.booleans()):
        found["logprobs"] = draw(st.integers(0, 5))
    if endpoint == CHAT_COMPLETIONS and draw(st.booleans()):
        found["logprobs"] = True
        if draw(st.booleans()):
            found["top_logprobs"] = draw(st.integers(0, 20))
    for penalty in ("frequency_penalty", "presence_penalty"):
        if draw(st.booleans()):
            found[penalty] = draw(st.floats(-2, 2))
    if draw(st.booleans()):
        tokens = st.integers(0, VOCABULARY - 1).map(str)
        found["logit_bias"] = draw(st.dictionaries(tokens, st.floats(-100, 100), max_size=5))
    return found


@st.composite
def requests(draw: st.DrawFn) -> GenerationRequest:
    endpoint = draw(st.sampled_from([CHAT_COMPLETIONS, COMPLETIONS]))
    return GenerationRequest(
        "req_1",
        endpoint,
        draw(samplings),
        messages=({"role": "user", "content": "hi"},) if endpoint == CHAT_COMPLETIONS else None,
        prompt="hi" if endpoint == COMPLETIONS else None,
        options=draw(options(endpoint)),
    )


@given(requests(), st.integers(1, 4096))
def test_sampling_keywords_carry_every_field_the_line_set(request: GenerationRequest, limit: int) -> None:
    kwargs = sampling_kwargs(request, limit, vocabulary=VOCABULARY)
    sampling, options = request.sampling, request.options
    assert kwargs["max_tokens"] == limit
    assert (kwargs["temperature"], kwargs["top_p"]) == (sampling.temperature, sampling.top_p)
    assert kwargs["top_k"] == (sampling.top_k if sampling.top_k > 0 else 0)  # vLLM's "off" is 0
    assert kwargs["n"] == (1 if sampling.greedy else options.get("n", 1))  # vLLM: greedy runs once
    assert kwargs.get("seed") == sampling.seed
    assert kwargs.get("stop", []) == list(sampling.stop)
    if request.endpoint == COMPLETIONS:
        assert kwargs.get("logprobs") == options.get("logprobs")
    else:
        expected = options.get("top_logprobs") or 0 if options.get("logprobs") else None
        assert kwargs.get("logprobs") == expected
    for penalty in ("frequency_penalty", "presence_penalty"):
        assert kwargs.get(penalty, 0.0) == float(options.get(penalty) or 0.0)
    bias = options.get("logit_bias") or {}
    assert kwargs.get("logit_bias") == ({int(token): value for token, value in bias.items()} or None)
    assert "structured_json" not in kwargs


@pytest.mark.parametrize("token", ["-1", str(VOCABULARY), "12345678"])
def test_a_logit_bias_for_a_token_the_model_lacks_is_refused(token: str) -> None:
    request = GenerationRequest(
        "req_1",
        COMPLETIONS,
        SamplingParameters(max_tokens=4),
        prompt="hi",
        options={"logit_bias": {token: 5}},
    )
    with pytest.raises(RequestRejected) as raised:
        sampling_kwargs(request, 4, vocabulary=VOCABULARY)
    assert raised.value.code == "invalid_request"


def _logprob(value: float, rank: int, text: str) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=rank, decoded_token=text)


@st.composite
def completions(draw: st.DrawFn, index: int, top: int | None) -> SimpleNamespace:
    tokens = draw(st.lists(st.integers(0, VOCABULARY - 1), min_size=1, max_size=6))
    steps = None
    if top is not None:
        steps = []
        for token in tokens:
            others = draw(st.lists(st.integers(0, VOCABULARY - 1), min_size=top, max_size=top, unique=True))
            values = sorted((draw(st.floats(-20, 0)) for _ in others), reverse=True)
            step = {
                other: _logprob(value, rank, f"t{other}")
                for rank, (other, value) in enumerate(zip(others, values, strict=True), 1)
            }
            step.setdefault(token, _logprob(-25.0, top + 1, f"t{token}"))  # the chosen one, maybe unranked
            steps.append(step)
    return SimpleNamespace(
        index=index,
        text="".join(f"t{token}" for token in tokens),
        token_ids=tokens,
        logprobs=steps,
        finish_reason=draw(st.sampled_from(["stop", "length"])),
    )


@st.composite
def outputs(draw: st.DrawFn) -> tuple[GenerationRequest, SimpleNamespace]:
    n = draw(st.integers(1, 4))
    top = draw(st.one_of(st.none(), st.integers(0, 3)))
    options: dict[str, Any] = {"n": n}
    if top is not None:
        options.update(logprobs=True, top_logprobs=top)
    request = GenerationRequest(
        "req_1",
        CHAT_COMPLETIONS,
        SamplingParameters(max_tokens=8),
        messages=({"role": "user", "content": "hi"},),
        options=options,
    )
    choices = [draw(completions(index, top)) for index in range(n)]
    prompt_ids = draw(st.lists(st.integers(0, VOCABULARY - 1), min_size=1, max_size=40))
    cached = draw(st.integers(-3, len(prompt_ids) + 3))
    shuffled = draw(st.permutations(choices))
    return request, SimpleNamespace(outputs=shuffled, prompt_token_ids=prompt_ids, num_cached_tokens=cached)


@given(outputs())
def test_results_count_every_choice_and_rank_the_top_tokens(
    case: tuple[GenerationRequest, SimpleNamespace],
) -> None:
    request, output = case
    result = result_of(
        request, output, prompt_text="hi", opens_reasoning=False, token_text=lambda token: f"t{token}"
    )
    ordered = sorted(output.outputs, key=lambda choice: choice.index)
    assert result.prompt_tokens == len(output.prompt_token_ids)
    assert result.completion_tokens == sum(len(choice.token_ids) for choice in ordered)
    assert (result.text, result.finish_reason) == (ordered[0].text, ordered[0].finish_reason)
    top = request.options.get("top_logprobs")
    if len(ordered) == 1 and "logprobs" not in request.options:
        assert result.choices is None
    else:
        assert result.choices is not None
        assert [choice["index"] for choice in result.choices] == list(range(len(ordered)))
        for shaped, choice in zip(result.choices, ordered, strict=True):
            assert shaped["message"]["content"] == choice.text
            assert shaped["finish_reason"] == choice.finish_reason
            if top is None:
                assert shaped["logprobs"] is None
                continue
            content = shaped["logprobs"]["content"]
            assert [entry["token"] for entry in content] == [f"t{token}" for token in choice.token_ids]
            for entry, token, step in zip(content, choice.token_ids, choice.logprobs, strict=True):
                assert entry["logprob"] == step[token].logprob
                ranked = sorted((e for e in step.values() if e.rank <= top), key=lambda e: e.rank)
                assert [t["logprob"] for t in entry["top_logprobs"]] == [e.logprob for e in ranked]
                assert all(not math.isnan(t["logprob"]) for t in entry["top_logprobs"])
    within = 0 <= output.num_cached_tokens <= len(output.prompt_token_ids)
    assert result.cached_tokens == (output.num_cached_tokens if within else None)


@pytest.mark.parametrize("reason", ["abort", "error", None])
def test_an_output_that_did_not_finish_normally_is_a_transient_failure(reason: str | None) -> None:
    request = GenerationRequest("req_1", COMPLETIONS, SamplingParameters(max_tokens=4), prompt="hi")
    output = SimpleNamespace(
        outputs=[SimpleNamespace(index=0, text="x", token_ids=[1], logprobs=None, finish_reason=reason)],
        prompt_token_ids=[1, 2],
        num_cached_tokens=0,
    )
    with pytest.raises(TransientBackendError):
        result_of(request, output, prompt_text="hi", opens_reasoning=False, token_text=str)
