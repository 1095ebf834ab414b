"""The ``/v1/embeddings`` and ``/v1/responses`` line bodies, structured-output shapes and backend
capabilities, as pure functions."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends.capabilities import (
    TEXT_ONLY,
    TEXT_WITH_FEATURES,
    Capabilities,
    features_used,
    passed_options,
    unsupported_problem,
)
from batchgen.core.errors import InvalidRequest
from batchgen.core.models import GenerationResult
from batchgen.core.requests.embeddings_api import (
    decode_base64,
    encode_base64,
    fit_dimensions,
    read_inputs,
    shorten,
)
from batchgen.core.requests.responses_api import chat_messages, response_body
from batchgen.core.requests.schema import ResponsesBody, read_body, read_envelope
from batchgen.core.requests.structured_output import response_format_problem

float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(st.lists(float32s, min_size=1, max_size=64))
def test_base64_is_little_endian_float32_and_decodes_to_the_same_floats(vector: list[float]) -> None:
    encoded = encode_base64(vector)
    assert decode_base64(encoded) == vector
    import base64

    assert len(base64.b64decode(encoded)) == 4 * len(vector)


@given(
    st.lists(st.floats(-10, 10), min_size=2, max_size=32).filter(lambda v: math.hypot(*v[:1]) > 1e-3),
    st.data(),
)
def test_shortening_keeps_the_head_and_unit_length(vector: list[float], data: st.DataObject) -> None:
    dimensions = data.draw(st.integers(1, len(vector)))
    short = shorten(vector, dimensions)
    assert len(short) == dimensions
    assert abs(math.hypot(*short) - 1) < 1e-9
    scale = math.hypot(*vector[:dimensions])
    assert all(abs(a * scale - b) < 1e-9 for a, b in zip(short, vector, strict=False))


def test_more_dimensions_than_the_model_has_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="this model's embeddings have 3 dimensions"):
        fit_dimensions([(1.0, 0.0, 0.0)], 4)
    assert fit_dimensions([(0.6, 0.8, 0.0)], 3) == ((0.6, 0.8, 0.0),)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hi", ("hi",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1], [2, 3]], ((1,), (2, 3))),
        (["a", [4]], ("a", (4,))),
    ],
)
def test_embedding_inputs_in_every_openai_form(value: Any, expected: tuple[Any, ...]) -> None:
    assert read_inputs(value) == expected


@pytest.mark.parametrize("value", ["", [], [""], [[]], [-1], [1.5], {"a": 1}, None, ["x"] * 2049, [True]])
def test_malformed_embedding_inputs_are_refused(value: Any) -> None:
    with pytest.raises(InvalidRequest):
        read_inputs(value)


def _body(url: str, body: dict[str, Any]) -> Any:
    line = {"custom_id": "a", "method": "POST", "url": url, "body": body}
    return read_body(read_envelope(json.dumps(line).encode()))


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "x", "encoding_format": "hex"}, "'float' or 'base64'"),
        ({"input": "x", "dimensions": 0}, "at least 1"),
        ({}, "missing 'body.input'"),
    ],
)
def test_embeddings_bodies_are_checked(body: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        _body("/v1/embeddings", body)


def test_responses_input_becomes_chat_messages() -> None:
    assert chat_messages("Be brief.", "hi") == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    )
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
    ]
    assert chat_messages(None, items) == (
        {"role": "system", "content": "rules"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "ab"},
    )
    with pytest.raises(InvalidRequest, match="role"):
        chat_messages(None, [{"role": "tool", "content": "x"}])


def test_a_responses_body_maps_text_format_and_output_limit_onto_the_chat_path() -> None:
    schema = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}
    body = _body("/v1/responses", {"input": "hi", "text": {"format": schema}, "max_output_tokens": 5})
    assert isinstance(body, ResponsesBody)
    assert body.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
    }
    assert body.max_completion_tokens == 5
    answer = response_body("m", GenerationResult("hello", "stop", 3, 2), 1, body)
    assert answer["output_text"] == "hello" and answer["status"] == "completed"
    assert answer["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
    }


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, None),
        ({"type": "json_schema", "json_schema": {"name": "a_b-1", "schema": {"type": "object"}}}, None),
        ({"type": "json_schema"}, "needs a 'json_schema' object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "JSON Schema object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}, "boolean"),
        ({"type": "grammar"}, "'type' must be one of"),
        ("json", "must be an object"),
    ],
)
def test_response_format_shapes(value: Any, problem: str | None) -> None:
    found = response_format_problem(value)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_features_a_line_uses_and_what_a_backend_is_handed() -> None:
    body = _body(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "n": 2, "logprobs": True, "top_logprobs": 1},
    )
    assert features_used("/v1/chat/completions", body) == ["logprobs", "n"]
    assert passed_options(TEXT_WITH_FEATURES, "/v1/chat/completions", body) == {
        "logprobs": True,
        "top_logprobs": 1,
        "n": 2,
    }
    assert passed_options(TEXT_ONLY, "/v1/chat/completions", body) == {}
    plain = _body(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1, "logprobs": False}
    )
    assert features_used("/v1/chat/completions", plain) == []
    with pytest.raises(InvalidRequest, match=r"needs 'body\.logprobs': true"):
        _body("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})


def test_sglang_gets_response_format_as_its_json_schema_parameter() -> None:
    from batchgen.core.backends.sglang_engine import sampling_params
    from batchgen.core.models import SamplingParameters

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    params = sampling_params(SamplingParameters(max_tokens=4), 4, {"response_format": fmt})
    assert json.loads(params["json_schema"]) == schema
    params = sampling_params(
        SamplingParameters(max_tokens=4), 4, {"response_format": {"type": "json_object"}}
    )
    assert json.loads(params["json_schema"]) == {"type": "object"}
    assert "json_schema" not in sampling_params(SamplingParameters(max_tokens=4), 4, {})


@given(choices=st.integers(1, 128), limit=st.integers(1, 16))
def test_a_backends_choice_limit_refuses_more_choices_and_names_the_field(choices: int, limit: int) -> None:
    capabilities = Capabilities(features=TEXT_WITH_FEATURES.features, max_choices=limit)
    body = _body("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": choices})
    problem = unsupported_problem("m", "transformers", capabilities, "/v1/chat/completions", body)
    if choices <= limit:
        assert problem is None
    else:
        assert (
            problem
            == f"'body.n': model 'm' (transformers backend) gives at most {limit} choices per line, got {choices}"
        )
