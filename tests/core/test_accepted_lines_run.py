"""Accepted means runnable on the real renderer: every line upload validation accepts for the
transformers backend renders through the model's chat template and tokenizer and runs, or is
refused for a reason of its own (an ``invalid_request`` or ``context_length_exceeded`` line).
It never fails as the engine's fault (``transient``, which ends as ``backend_error`` after the
retries), and never breaks the other rows of its step.

Hypothesis builds chat lines with any roles, null, missing, string or list content, tool calls
and the other message fields OpenAI bodies carry, completions lines with any prompt (the empty
one included) and Responses lines; validation decides with the transformers backend's own
capabilities, and the accepted ones run in the decode engine of the tiny model (``model``),
each beside an ordinary line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.backends.hf_decode import REJECTED, DecodeEngine
from batchgen.core.backends.hf_transformers import TransformersBackend
from batchgen.core.backends.served_models import ModelSet, Route, ServedModel
from batchgen.core.errors import InvalidBatchFile
from batchgen.core.execution.line_requests import generation_request
from batchgen.core.files.batch_file import validate_batch_file
from batchgen.core.models import BatchParameters, GenerationRequest, SamplingParameters
from batchgen.core.requests.parameters import ServerDefaults
from batchgen.core.requests.schema import read_body, read_envelope
from tests.examples import examples
from tests.tiny_engine import run_to_end, tiny_engine

pytestmark = [pytest.mark.model]

_SERVED = ServedModel(
    SimpleNamespace(name="transformers", model_name="tiny", capabilities=TransformersBackend.capabilities)
)
_MODELS = ModelSet([_SERVED])
_OWN_FAULTS = ("invalid_request", "context_length_exceeded")


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeEngine]:
    with tiny_engine(tiny_model, tmp_path_factory.mktemp("cache"), max_batch_size=4) as engine:
        yield engine


_text = st.text(max_size=30)
_part = st.fixed_dictionaries({"type": st.just("text"), "text": _text}) | st.fixed_dictionaries(
    {"type": st.sampled_from(["image_url", "input_audio"])}
)
_tool_call = st.fixed_dictionaries(
    {
        "id": st.just("call_1"),
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.just("lookup"), "arguments": st.just('{"q": 1}')}),
    }
)


@st.composite
def _message(draw: st.DrawFn) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": draw(
            st.sampled_from(["user", "system", "assistant", "tool", "developer", "function"]) | _text
        )
    }
    content = draw(st.sampled_from(["string", "null", "missing", "parts"]))
    if content == "string":
        message["content"] = draw(_text)
    elif content == "null":
        message["content"] = None
    elif content == "parts":
        message["content"] = draw(st.lists(_part, max_size=3))
    if draw(st.booleans()):
        message["tool_calls"] = draw(st.lists(_tool_call, max_size=2))
    if draw(st.booleans()):
        message[draw(st.sampled_from(["name", "tool_call_id", "refusal"]))] = draw(_text)
    return message


_chat_body = st.fixed_dictionaries({"messages": st.lists(_message(), min_size=1, max_size=4)})
_completion_body = st.fixed_dictionaries({"prompt": _text | st.sampled_from(["", " ", "\n", "\x00"])})
_responses_body = st.fixed_dictionaries(
    {
        "input": _text
        | st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": _text}
            ),
            min_size=1,
            max_size=3,
        )
    },
    optional={"instructions": _text},
)
_lines = st.one_of(
    _chat_body.map(lambda body: ("/v1/chat/completions", body)),
    _completion_body.map(lambda body: ("/v1/completions", body)),
    _responses_body.map(lambda body: ("/v1/responses", body)),
)


def _accepted(tmp_path: Path, url: str, body: dict[str, Any]) -> bool:
    path = tmp_path / "line.jsonl"
    line = {"custom_id": "c", "method": "POST", "url": url, "body": body}
    path.write_text(json.dumps(line) + "\n")
    try:
        validate_batch_file(str(path), _MODELS)
    except InvalidBatchFile:
        return False
    return True


def _request(request_id: str, url: str, body: dict[str, Any]) -> GenerationRequest:
    envelope = read_envelope(
        json.dumps({"custom_id": request_id, "method": "POST", "url": url, "body": body}).encode()
    )
    return generation_request(
        request_id,
        envelope,
        read_body(envelope),
        Route(_SERVED, None),
        BatchParameters(),
        ServerDefaults(max_tokens=2),
    )


_ORDINARY = GenerationRequest(
    request_id="ordinary",
    endpoint="/v1/completions",
    sampling=SamplingParameters(max_tokens=2),
    prompt="The sky is",
)


@given(line=_lines, alone=st.booleans())
@settings(
    max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_an_accepted_line_runs_or_is_refused_for_its_own_reason(
    engine: DecodeEngine, tmp_path: Path, line: tuple[str, dict[str, Any]], alone: bool
) -> None:
    url, body = line
    if not _accepted(tmp_path, url, body):
        return
    request = _request("line", url, body)
    outcomes = run_to_end(engine, request) if alone else run_to_end(engine, request, _ORDINARY)
    outcome = outcomes["line"]
    if outcome.failure is not None:
        assert outcome.failure.kind == REJECTED and outcome.failure.code in _OWN_FAULTS, outcome.failure
    else:
        assert outcome.result is not None and outcome.result.completion_tokens >= 1
    if not alone:
        assert outcomes["ordinary"].failure is None, outcomes["ordinary"]


@pytest.mark.parametrize(
    ("url", "body"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "What is the weather?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ]
            },
        ),
        ("/v1/completions", {"prompt": ""}),
    ],
    ids=["assistant-null-content-with-tool-calls", "empty-prompt"],
)
def test_the_reported_linesrun_to_end(
    engine: DecodeEngine, tmp_path: Path, url: str, body: dict[str, Any]
) -> None:
    assert _accepted(tmp_path, url, body)
    for outcomes in (
        run_to_end(engine, _request("line", url, body)),
        run_to_end(engine, _request("line", url, body), _ORDINARY),
    ):
        assert outcomes["line"].failure is None, outcomes["line"].failure
        assert outcomes["line"].result is not None and outcomes["line"].result.completion_tokens == 2
