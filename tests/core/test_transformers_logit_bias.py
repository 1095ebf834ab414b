"""``logit_bias`` on the transformers decode loop, with the tiny random-weight model (``model``).

A bias is added to a row's logits before its token is chosen: +100 on any token makes greedy
decoding choose it at every step, -100 on the token greedy decoding chose first makes it choose
another; a row without a bias in the same batch is unchanged, and a token id outside the model's
vocabulary is that request's rejection (``invalid_request``), never an index error in the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.backends.hf_decode import REJECTED, DecodeEngine
from batchgen.core.models import CHAT_COMPLETIONS, GenerationRequest, SamplingParameters
from tests.examples import examples
from tests.tiny_engine import run_to_end, tiny_engine

pytestmark = [pytest.mark.model]


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeEngine]:
    with tiny_engine(tiny_model, tmp_path_factory.mktemp("cache"), max_batch_size=8) as engine:
        yield engine


def _chat(request_id: str, options: dict[str, Any]) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        endpoint=CHAT_COMPLETIONS,
        sampling=SamplingParameters(max_tokens=4, temperature=0.0),
        messages=({"role": "user", "content": "Name a colour."},),
        options=options,
    )


@settings(
    max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(token=st.integers(0, 40_000))
def test_a_strong_bias_decides_the_greedy_token(engine: DecodeEngine, token: int) -> None:
    outcomes = run_to_end(engine, _chat("plain", {}), _chat("biased", {"logit_bias": {str(token): 100}}))
    plain, biased = outcomes["plain"], outcomes["biased"]
    assert plain.result is not None and biased.result is not None
    assert biased.result.completion_tokens == 4
    again = run_to_end(engine, _chat("plain-again", {}))["plain-again"]
    assert again.result is not None and again.result.text == plain.result.text  # the bias stayed in its row
    expected = engine._tokenizer.decode([token] * 4, skip_special_tokens=True)
    assert biased.result.text == expected


def _first_token(engine: DecodeEngine, request: GenerationRequest) -> int:
    """The first token greedy decoding chooses for ``request`` (read from its row), then run out."""
    engine.add(request)
    while not any(row.generated for row in engine._running):
        engine.step()
    token = next(row.generated[0] for row in engine._running if row.generated)
    while engine.busy:
        engine.step()
    return token


def test_a_negative_bias_bans_the_greedy_first_token(engine: DecodeEngine) -> None:
    first = _first_token(engine, _chat("plain", {}))
    assert _first_token(engine, _chat("plain-again", {})) == first
    assert _first_token(engine, _chat("banned", {"logit_bias": {str(first): -100}})) != first
    assert _first_token(engine, _chat("nudged", {"logit_bias": {str(first): 0}})) == first


def test_a_token_outside_the_vocabulary_is_the_requests_rejection(engine: DecodeEngine) -> None:
    outcomes = run_to_end(engine, _chat("outside", {"logit_bias": {"999999999": 5}}), _chat("fine", {}))
    failure = outcomes["outside"].failure
    assert failure is not None and failure.kind == REJECTED and failure.code == "invalid_request"
    assert "vocabulary" in failure.message
    assert outcomes["fine"].result is not None
