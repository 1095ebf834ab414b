"""Parameter priority: per-request body over batch level over server default (greedy)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.models import BatchParameters
from batchgen.core.requests.parameters import ServerDefaults, sets_sampling
from batchgen.core.requests.parameters import resolve_sampling as resolve_body
from batchgen.core.requests.sampling_ranges import RULES
from batchgen.core.requests.schema import ChatBody

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


_BODY_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 4096),
        "max_completion_tokens": st.integers(1, 4096),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.sampled_from([-1, 1, 40]),
        "seed": st.integers(0, 2**31),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=4)),
        "n": st.just(1),
        "model": st.just("default"),
    },
)
_BATCHES = st.builds(
    BatchParameters,
    max_decoding_length=st.one_of(st.none(), st.integers(1, 512)),
    temperature=st.one_of(st.none(), st.floats(0, 2)),
    top_p=st.one_of(st.none(), st.floats(0.01, 1)),
    top_k=st.one_of(st.none(), st.integers(1, 50)),
)


@given(body=_BODY_FIELDS, batch=_BATCHES)
def test_a_body_that_sets_no_sampling_field_resolves_to_the_batch_level(
    body: dict[str, Any], batch: BatchParameters
) -> None:
    """The executor resolves such bodies once per batch: they must all resolve alike."""
    decoded = msgspec.convert({"messages": [{"role": "user"}], **body}, ChatBody)
    batch_level = resolve_body(msgspec.convert({"messages": [{"role": "user"}]}, ChatBody), batch, DEFAULTS)
    if not sets_sampling(decoded):
        assert resolve_body(decoded, batch, DEFAULTS) == batch_level
    else:
        assert set(body) - {"n", "model"}, "a body with no sampling field was said to set one"
