"""No body field is accepted and then silently ignored, and every per-line list is bounded.

``stop`` strings and lists, and ``logit_bias`` maps, have bounds checked at parse time (Hypothesis
on their sizes and values, at and past each bound). OpenAI's fields that change the answer but
that a backend does not run (``logit_bias``, the penalties, tools, audio, web search, and the
completions ``echo``/``suffix``/``best_of``) are refused at upload naming the line and the field,
unless their value asks for nothing; a backend that declares one (the openai upstream declares
``logit_bias`` and the penalties, sglang the penalties, transformers both) gets it in the request's
options. A penalty is accepted on a model whose backend runs it only from -2 to 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.backends.capabilities import (
    UPSTREAM_SAMPLING,
    Capabilities,
    capabilities_of,
    passed_options,
)
from batchgen.core.backends.hf_transformers import TransformersBackend
from batchgen.core.backends.openai_upstream import OpenAIUpstreamBackend
from batchgen.core.backends.served_models import ModelSet, ServedModel
from batchgen.core.backends.sglang_engine import SGLangBackend
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import InvalidBatchFile, InvalidRequest
from batchgen.core.files.batch_file import validate_batch_file
from batchgen.core.models import CHAT_COMPLETIONS
from batchgen.core.requests.sampling_ranges import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
)
from batchgen.core.requests.schema import read_body, read_envelope
from tests.examples import examples
from tests.helpers import chat_line, completion_line


def _problem(line: dict[str, Any]) -> InvalidRequest | None:
    try:
        read_body(read_envelope(json.dumps(line).encode()))
    except InvalidRequest as exc:
        return exc
    return None


@settings(max_examples=examples(80), deadline=None)
@given(
    lengths=st.lists(st.integers(0, 2 * MAX_STOP_CHARS), min_size=0, max_size=MAX_STOP_SEQUENCES + 2),
    as_string=st.booleans(),
)
def test_stop_strings_and_lists_are_bounded(lengths: list[int], as_string: bool) -> None:
    stop: str | list[str] = "x" * lengths[0] if as_string and lengths else ["y" * n for n in lengths]
    allowed = (
        len(stop) <= MAX_STOP_CHARS
        if isinstance(stop, str)
        else len(stop) <= MAX_STOP_SEQUENCES and all(n <= MAX_STOP_CHARS for n in lengths)
    )
    problem = _problem(chat_line("a", stop=stop))
    assert (problem is None) == allowed
    if problem is not None:
        assert problem.param == "body.stop" and len(problem.message) < 300  # the value is not echoed whole


def test_a_megabyte_stop_string_is_refused() -> None:
    problem = _problem(chat_line("a", stop="z" * 1_000_000))
    assert problem is not None and f"each at most {MAX_STOP_CHARS} characters" in problem.message


_token_ids = st.integers(0, 10**6).map(str) | st.sampled_from(["-1", "a", "1.5", "", "١٢"])
_biases = st.integers(-2 * MAX_LOGIT_BIAS, 2 * MAX_LOGIT_BIAS) | st.floats(-200, 200, allow_nan=False)


@settings(max_examples=examples(80), deadline=None)
@given(
    bias=st.dictionaries(_token_ids, _biases, max_size=4)
    | st.dictionaries(st.integers(0, 10**5).map(str), st.just(1), min_size=290, max_size=310)
)
def test_logit_bias_is_token_ids_to_bounded_numbers(bias: dict[str, float]) -> None:
    allowed = len(bias) <= MAX_LOGIT_BIAS_ENTRIES and all(
        key.isascii() and key.isdigit() and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
        for key, value in bias.items()
    )
    problem = _problem(chat_line("a", logit_bias=bias))
    assert (problem is None) == allowed
    if problem is not None:
        assert problem.param == "body.logit_bias"


def _models() -> ModelSet:
    return ModelSet([ServedModel(SimulatedBackend())])


#: Fields a backend must run or refuse, each with a value that asks for something and one that
#: asks for nothing, and the endpoint they belong to.
UNAPPLIED = [
    ("logit_bias", {"42": 5}, {}, "chat"),
    ("frequency_penalty", 0.5, 0, "chat"),
    ("presence_penalty", -1, 0.0, "completions"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], [], "chat"),
    ("functions", [{"name": "f"}], [], "chat"),
    ("tool_choice", "required", "none", "chat"),
    ("function_call", {"name": "f"}, "auto", "chat"),
    ("modalities", ["text", "audio"], ["text"], "chat"),
    ("audio", {"voice": "alloy", "format": "wav"}, None, "chat"),
    ("web_search_options", {}, None, "chat"),
    ("echo", True, False, "completions"),
    ("suffix", "end", "", "completions"),
    ("best_of", 3, 1, "completions"),
]


def _line(endpoint: str, **body: Any) -> dict[str, Any]:
    return chat_line("a", **body) if endpoint == "chat" else completion_line("a", "Once", **body)


def _validate(
    tmp_path: Path, line: dict[str, Any], models: ModelSet | None = None
) -> InvalidBatchFile | None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    try:
        validate_batch_file(str(path), models or _models())
    except InvalidBatchFile as exc:
        return exc
    return None


@pytest.mark.parametrize(
    ("field", "asks", "nothing", "endpoint"), UNAPPLIED, ids=[row[0] for row in UNAPPLIED]
)
def test_a_field_no_backend_runs_is_refused_naming_it(
    tmp_path: Path, field: str, asks: Any, nothing: Any, endpoint: str
) -> None:
    refused = _validate(tmp_path, _line(endpoint, **{field: asks}))
    assert refused is not None, f"{field}={asks!r} was accepted and would be ignored"
    message = refused.problems[0].message
    assert refused.problems[0].line == 1
    assert f"'body.{field}'" in message and "does not support" in message
    assert _validate(tmp_path, _line(endpoint, **{field: nothing})) is None


def test_the_openai_backend_passes_logit_bias_and_the_penalties_on() -> None:
    capabilities = capabilities_of(OpenAIUpstreamBackend(upstreams=["http://127.0.0.1:9/v1"]))
    assert capabilities.features >= UPSTREAM_SAMPLING
    line = chat_line("a", logit_bias={"42": 5}, frequency_penalty=0.5, presence_penalty=-1, tools=[{"x": 1}])
    body = read_body(read_envelope(json.dumps(line).encode()))
    options = passed_options(capabilities, CHAT_COMPLETIONS, body)
    assert options == {"logit_bias": {"42": 5.0}, "frequency_penalty": 0.5, "presence_penalty": -1.0}
    assert passed_options(Capabilities(), CHAT_COMPLETIONS, body) == {}


def _sglang_models() -> ModelSet:
    return ModelSet([ServedModel(SGLangBackend(model_path="m"), name="a")])


def test_the_sglang_and_transformers_backends_get_the_penalties() -> None:
    line = chat_line("a", frequency_penalty=0.5, presence_penalty=-1, logit_bias={"42": 5})
    body = read_body(read_envelope(json.dumps(line).encode()))
    penalties = {"frequency_penalty": 0.5, "presence_penalty": -1.0}
    sglang = capabilities_of(SGLangBackend(model_path="m"))
    assert passed_options(sglang, CHAT_COMPLETIONS, body) == penalties
    transformers = capabilities_of(TransformersBackend())
    assert passed_options(transformers, CHAT_COMPLETIONS, body) == {**penalties, "logit_bias": {"42": 5.0}}


@pytest.mark.parametrize(
    ("field", "asks", "nothing", "endpoint"), UNAPPLIED, ids=[row[0] for row in UNAPPLIED]
)
def test_sglang_accepts_the_penalties_and_refuses_every_other_field_it_does_not_run(
    tmp_path: Path, field: str, asks: Any, nothing: Any, endpoint: str
) -> None:
    refused = _validate(tmp_path, _line(endpoint, **{field: asks}), _sglang_models())
    if field in ("frequency_penalty", "presence_penalty"):
        assert refused is None, refused
    else:
        assert refused is not None, f"{field}={asks!r} was accepted for sglang and would be ignored"
        assert refused.problems[0].line == 1
        assert f"'body.{field}'" in refused.problems[0].message
        assert "(sglang backend) does not support" in refused.problems[0].message
    assert _validate(tmp_path, _line(endpoint, **{field: nothing}), _sglang_models()) is None


_penalty_values = (
    st.integers(-5, 5)
    | st.floats(-4, 4, allow_nan=False)
    | st.sampled_from([2.0000001, -2.0000001, 1e300, -1e300, 2, -2, 0])
)


@settings(max_examples=examples(60), deadline=None)
@given(
    field=st.sampled_from(["frequency_penalty", "presence_penalty"]),
    value=_penalty_values,
    endpoint=st.sampled_from(["chat", "completions"]),
    backend=st.sampled_from(["sglang", "transformers"]),
)
def test_a_penalty_is_accepted_only_from_minus_two_to_two_where_it_runs(
    tmp_path_factory: pytest.TempPathFactory, field: str, value: float, endpoint: str, backend: str
) -> None:
    built = SGLangBackend(model_path="m") if backend == "sglang" else TransformersBackend()
    models = ModelSet([ServedModel(built, name="a")])
    refused = _validate(tmp_path_factory.mktemp("penalty"), _line(endpoint, **{field: value}), models)
    if -2 <= value <= 2:
        assert refused is None, refused
    else:
        assert refused is not None, f"{field}={value!r} was accepted for {backend}"
        [problem] = refused.problems
        assert problem.line == 1
        assert f"'body.{field}'" in problem.message and "between -2 and 2" in problem.message
