"""Parameter priority: per-request body over batch level over server default (greedy)."""

from __future__ import annotations

import pytest

from batchgen.core.errors import InvalidRequest
from batchgen.core.models import BatchParameters
from batchgen.core.parameters import ServerDefaults, resolve_sampling

DEFAULTS = ServerDefaults(max_tokens=256)


def test_nothing_set_is_greedy_with_the_server_limit() -> None:
    sampling = resolve_sampling({}, BatchParameters(), DEFAULTS)
    assert sampling.greedy and sampling.max_tokens == 256
    assert (sampling.top_p, sampling.top_k, sampling.stop) == (1.0, -1, ())


def test_batch_level_overrides_the_server_default() -> None:
    batch = BatchParameters(max_decoding_length=64, temperature=0.7, top_p=0.9, top_k=40)
    sampling = resolve_sampling({}, batch, DEFAULTS)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (64, 0.7, 0.9, 40)


def test_body_overrides_the_batch_level() -> None:
    batch = BatchParameters(max_decoding_length=64, temperature=0.7, top_p=0.9, top_k=40)
    body = {"max_tokens": 8, "temperature": 0.3, "top_p": 0.5, "top_k": 5, "seed": 11, "stop": "END"}
    sampling = resolve_sampling(body, batch, DEFAULTS)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (8, 0.3, 0.5, 5)
    assert sampling.seed == 11 and sampling.stop == ("END",)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    sampling = resolve_sampling(
        {"max_completion_tokens": 5, "max_tokens": 9}, BatchParameters(max_decoding_length=64), DEFAULTS
    )
    assert sampling.max_tokens == 5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_malformed_values_name_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        resolve_sampling(body, BatchParameters(), DEFAULTS)
    assert caught.value.param == param
