"""OpenAI's ``frequency_penalty`` and ``presence_penalty`` on the transformers decode loop, with the
tiny random-weight model (``model``).

At every step a row's logits lose ``frequency_penalty`` times each token's count in the row's
output so far, and ``presence_penalty`` for each token that has appeared in it. The engine's greedy
answer (in a batch with other rows) is checked against a plain reference decode of the same prompt
that applies that formula itself, for drawn penalties from -2 to 2; a row without penalties in the
same batch is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.backends.hf_decode import DecodeEngine
from batchgen.core.models import CHAT_COMPLETIONS, GenerationRequest, SamplingParameters
from tests.examples import examples
from tests.tiny_engine import run_to_end, tiny_engine

pytestmark = [pytest.mark.model]

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeEngine]:
    with tiny_engine(tiny_model, tmp_path_factory.mktemp("cache"), max_batch_size=8) as engine:
        yield engine


def _chat(request_id: str, options: dict[str, Any], content: str = "Name a colour.") -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        endpoint=CHAT_COMPLETIONS,
        sampling=SamplingParameters(max_tokens=MAX_TOKENS, temperature=0.0),
        messages=({"role": "user", "content": content},),
        options=options,
    )


def _reference(
    engine: DecodeEngine, request: GenerationRequest, frequency: float, presence: float
) -> list[int]:
    """Greedy decoding of the request's prompt with its ``logit_bias`` added and the penalties
    subtracted by OpenAI's formula, recomputing the whole sequence at each step (no cache, no batch)."""
    import torch

    prompt, _ = engine._prompt_ids(request)
    bias = {int(token): value for token, value in (request.options.get("logit_bias") or {}).items()}
    generated: list[int] = []
    with torch.no_grad():
        while len(generated) < MAX_TOKENS:
            logits = engine._model(input_ids=torch.tensor([prompt + generated])).logits[0, -1].float()
            for token, value in bias.items():
                logits[token] += value
            for token in set(generated):
                logits[token] -= frequency * generated.count(token) + presence
            token = int(logits.argmax())
            generated.append(token)
            if token in engine._eos_ids:
                break
    return generated


def _text(engine: DecodeEngine, tokens: list[int]) -> str:
    return str(engine._tokenizer.decode(tokens, skip_special_tokens=True))


def _check(engine: DecodeEngine, options: dict[str, Any], frequency: float, presence: float) -> list[int]:
    """Run ``options`` beside a plain row; assert both match the reference; the expected tokens."""
    penalized = _chat("penalized", options)
    outcomes = run_to_end(engine, _chat("plain", {}, "Say something."), penalized)
    result = outcomes["penalized"].result
    assert result is not None
    expected = _reference(engine, penalized, frequency, presence)
    assert (result.text, result.completion_tokens) == (_text(engine, expected), len(expected))
    plain = outcomes["plain"].result
    unpenalized = _reference(engine, _chat("plain", {}, "Say something."), 0, 0)
    assert plain is not None and plain.text == _text(engine, unpenalized)  # they stayed in their row
    return expected


def _first_greedy_token(engine: DecodeEngine) -> int:
    return _reference(engine, _chat("plain", {}), 0, 0)[0]


_penalty = st.sampled_from([0, 2, -2, 0.4, -0.5]) | st.floats(-2, 2, allow_nan=False, width=32)


@settings(
    max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frequency=_penalty, presence=_penalty, bias=st.sampled_from([0, 0.5, 1, 1.5, 3]))
def test_the_penalties_follow_openais_formula(
    engine: DecodeEngine, frequency: float, presence: float, bias: float
) -> None:
    # A bias on the first greedy token makes the untouched answer repeat it, so that positive
    # penalties have repeats to act on (the tiny model's own greedy answer never repeats).
    options: dict[str, Any] = {"frequency_penalty": frequency, "presence_penalty": presence}
    if bias:
        options["logit_bias"] = {str(_first_greedy_token(engine)): bias}
    _check(engine, options, frequency, presence)


#: (frequency, presence, whether the answer changes). Against a +1.5 bias on one token, a
#: frequency penalty of 0.4 wins after a few repeats (it grows with the count) but a presence
#: penalty of 0.4 never does (it is taken once): the two are not swapped.
CHANGES = [(2, 0, True), (0, 2, True), (-2, 0, True), (0, -2, True), (0.4, 0, True), (0, 0.4, False)]


@pytest.mark.parametrize(("frequency", "presence", "changes"), CHANGES)
def test_each_penalty_changes_the_answer_as_it_should(
    engine: DecodeEngine, frequency: float, presence: float, changes: bool
) -> None:
    token = _first_greedy_token(engine)
    bias = {"logit_bias": {str(token): 1.5}} if frequency > 0 or presence > 0 else {}
    untouched = _reference(engine, _chat("untouched", bias), 0, 0)
    options = {**bias, "frequency_penalty": frequency, "presence_penalty": presence}
    expected = _check(engine, options, frequency, presence)
    assert (expected != untouched) is changes
    if bias:
        assert untouched == [token] * MAX_TOKENS  # the bias alone repeats the token
