"""Parameter priority: per-request body over batch level over server default (greedy)."""

from __future__ import annotations

from typing import Any

import msgspec

from batchgen.core.models import BatchParameters
from batchgen.core.parameters import ServerDefaults
from batchgen.core.parameters import resolve_sampling as resolve_body
from batchgen.core.request_schema import ChatBody
from batchgen.core.sampling_ranges import RULES

DEFAULTS = ServerDefaults(max_tokens=256)


def resolve_sampling(body: dict[str, Any], batch: BatchParameters, defaults: ServerDefaults) -> Any:
    """Resolve a body as the executor does: decoded through the request schema first."""
    decoded = msgspec.convert({"messages": [{"role": "user"}], **body}, ChatBody)
    return resolve_body(decoded, batch, defaults)


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


def test_a_stop_string_is_one_stop_sequence_and_a_list_keeps_its_order() -> None:
    assert resolve_sampling({"stop": "END"}, BatchParameters(), DEFAULTS).stop == ("END",)
    assert resolve_sampling({"stop": ["b", "a"]}, BatchParameters(), DEFAULTS).stop == ("b", "a")


def test_the_server_default_is_a_valid_output_limit() -> None:
    assert RULES["max_tokens"].accepts(ServerDefaults().max_tokens)
