"""A line of any endpoint with k problems reports every one of them (bounded), in field order.

For each endpoint (chat, completions, responses, embeddings) Hypothesis draws a line with k
independent problems of the kinds that endpoint can have: envelope fields, body fields out of
range or of the wrong type, fields of the other endpoint, input items (messages, Responses input
items and their parts, embeddings inputs) and the checks made after the request schema with the
service's models: an unknown model, and each field the model's backend does not run. Validation
against real served models (the simulated backend, which runs no optional feature, and the openai
backend, which serves embeddings) must list exactly min(k, MAX_LINE_PROBLEMS) of them, each naming
its field, in the line's field order, and count the rest. An unknown model leaves no backend to
check the features against, so a line naming one has no feature problems.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.backends.openai_upstream import OpenAIUpstreamBackend
from batchgen.core.backends.served_models import ModelSet, ServedModel
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import InvalidBatchFile
from batchgen.core.files.batch_file import MAX_LINE_PROBLEMS, validate_batch_file
from tests.examples import examples

ITEMS = 12  # messages / input items per line, each of which may be broken

#: (body field, a value that breaks it, whether the problem is a feature the model's backend does
#: not run): each is one problem, reported under ``body.<field>``.
Field = tuple[str, Any, bool]
CHAT_FIELDS: list[Field] = [
    ("model", "no-such-model", False),
    ("logit_bias", {"7": 3}, True),
    ("max_tokens", 0, False),
    ("frequency_penalty", 0.5, True),
    ("ITEMS", None, False),  # where the messages go
    ("temperature", 9, False),
    ("tools", [{"type": "function", "function": {"name": "f"}}], True),
    ("n", 3, True),
    ("seed", "x", False),
    ("stop", "x" * 5000, False),
    ("stream", True, False),
    ("prompt", "belongs to completions", False),
    ("top_p", 3, False),
]
COMPLETION_FIELDS: list[Field] = [
    ("echo", True, True),
    ("max_tokens", -1, False),
    ("model", "no-such-model", False),
    ("suffix", "after", True),
    ("prompt", 5, False),  # the wrong type
    ("temperature", -1, False),
    ("presence_penalty", 1.0, True),
    ("logprobs", 9, False),
    ("messages", [{"role": "user", "content": "x"}], False),
    ("best_of", 3, True),
    ("top_k", -5, False),
    ("stream", True, False),
]
RESPONSES_FIELDS: list[Field] = [
    ("max_tokens", 5, False),  # a chat field
    ("model", "no-such-model", False),
    ("tools", [{"type": "function", "name": "f"}], False),
    ("ITEMS", None, False),  # where the input items go
    ("temperature", 9, False),
    ("previous_response_id", "resp_1", False),
    ("response_format", {"type": "json_object"}, False),  # a chat field
    ("store", True, False),
    ("top_logprobs", 3, True),
    ("background", True, False),
    ("max_output_tokens", 0, False),
    ("text", "plain", False),
    ("max_completion_tokens", 9, False),  # a chat field
]
EMBEDDINGS_FIELDS: list[Field] = [
    ("encoding_format", "hex", False),
    ("ITEMS", None, False),  # where the inputs go
    ("model", "no-such-model", False),
    ("dimensions", 0, False),
    ("user", 5, False),
]


def _chat_items(broken: set[tuple[str, int]]) -> tuple[list[Any], list[str]]:
    items, params = [], []
    for index in range(ITEMS):
        message: dict[str, Any] = {"role": "user", "content": "hi"}
        if ("role", index) in broken:
            message["role"] = "robot" if index % 2 else 5
            params.append(f"body.messages[{index}].role")
        if ("part", index) in broken:
            message["content"] = [{"type": "text"}]
            params.append(f"body.messages[{index}].content[0]")
        items.append(message)
    return items, params


def _responses_items(broken: set[tuple[str, int]]) -> tuple[list[Any], list[str]]:
    items, params = [], []
    for index in range(ITEMS):
        if ("item", index) in broken:
            items.append({"type": "function_call", "name": "f"})
            params.append(f"body.input[{index}]")
            continue
        item: dict[str, Any] = {"role": "user", "content": "hi"}
        if ("role", index) in broken:
            item["role"] = "robot"
            params.append(f"body.input[{index}].role")
        if ("part", index) in broken:
            item["content"] = [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]
            params.append(f"body.input[{index}].content")
        items.append(item)
    return items, params


def _embeddings_items(broken: set[tuple[str, int]]) -> tuple[list[Any], list[str]]:
    items, params = [], []
    for index in range(ITEMS):
        if ("item", index) in broken:
            items.append(["", 5, [], [-1], None][index % 5])
            params.append(f"body.input[{index}]")
        else:
            items.append(f"text {index}")
    return items, params


Endpoint = tuple[
    str, str, str, list[Field], Callable[[set[tuple[str, int]]], tuple[list[Any], list[str]]], tuple[str, ...]
]
#: (url, the served model a line names, the body field holding the items, its fields, its item
#: builder, the kinds of item problem)
ENDPOINTS: dict[str, Endpoint] = {
    "chat": ("/v1/chat/completions", "sim", "messages", CHAT_FIELDS, _chat_items, ("role", "part")),
    "completions": ("/v1/completions", "sim", "", COMPLETION_FIELDS, _chat_items, ()),
    "responses": (
        "/v1/responses",
        "sim",
        "input",
        RESPONSES_FIELDS,
        _responses_items,
        ("role", "part", "item"),
    ),
    "embeddings": ("/v1/embeddings", "up", "input", EMBEDDINGS_FIELDS, _embeddings_items, ("item",)),
}


def _models() -> ModelSet:
    upstream = OpenAIUpstreamBackend(upstreams=["http://127.0.0.1:9"], model="up")
    return ModelSet([ServedModel(SimulatedBackend(), name="sim"), ServedModel(upstream, name="up")])


def build(endpoint: str, kinds: set[tuple[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The line of ``endpoint`` with the problems ``kinds`` and the field each reported problem
    names, in order."""
    url, model, items_field, fields, items_of, _ = ENDPOINTS[endpoint]
    unknown_model = ("body", "model") in kinds
    body: dict[str, Any] = {}
    params: list[str] = []
    for name, value, feature in fields:
        if name == "ITEMS":
            items, item_params = items_of({kind for kind in kinds if kind[0] != "body" and kind[0] != "env"})
            body[items_field] = items
            params += item_params
        elif ("body", name) in kinds:
            body[name] = value
            if not (feature and unknown_model):  # no model: no backend to check a feature against
                params.append(f"body.{name}")
    body.setdefault("model", model)
    if endpoint == "completions":
        body.setdefault("prompt", "Once")
    line = {
        "custom_id": "" if ("env", "custom_id") in kinds else "a",
        "method": "PUT" if ("env", "method") in kinds else "POST",
        "url": url,
        "body": body,
    }
    envelope = [name for name in ("custom_id", "method") if ("env", name) in kinds]
    return line, envelope + params


def kinds_of(endpoint: str) -> list[tuple[str, Any]]:
    _, _, _, fields, _, item_kinds = ENDPOINTS[endpoint]
    return (
        [("env", "custom_id"), ("env", "method")]
        + [("body", name) for name, _, _ in fields if name != "ITEMS"]
        + [(kind, index) for kind in item_kinds for index in range(ITEMS)]
    )


@st.composite
def lines(draw: st.DrawFn) -> tuple[str, set[tuple[str, Any]]]:
    endpoint = draw(st.sampled_from(sorted(ENDPOINTS)))
    kinds = draw(st.sets(st.sampled_from(kinds_of(endpoint)), min_size=1))
    return endpoint, kinds


@settings(max_examples=examples(200), deadline=None)
@given(drawn=lines())
def test_every_problem_of_a_line_of_any_endpoint_is_reported_up_to_the_bound(
    tmp_path_factory: pytest.TempPathFactory, drawn: tuple[str, set[tuple[str, Any]]]
) -> None:
    endpoint, kinds = drawn
    line, params = build(endpoint, kinds)
    k = len(params)
    path = tmp_path_factory.mktemp("lines") / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(InvalidBatchFile) as raised:
        validate_batch_file(str(path), _models())
    error = raised.value
    shown = min(k, MAX_LINE_PROBLEMS)
    messages = [problem.message for problem in error.problems]
    assert len(messages) == shown, (endpoint, params, messages)
    assert all(problem.line == 1 for problem in error.problems)
    for message, param in zip(messages, params, strict=False):
        assert f"'{param}" in message, (endpoint, param, messages)
    assert error.problems[-1].left_out == k - shown
    assert error.total_problems == k
    assert (f"line 1: ... and {k - shown} more problems on this line" in str(error)) == (k > shown)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_a_line_of_good_fields_of_any_endpoint_has_no_problem(tmp_path: Any, endpoint: str) -> None:
    line, params = build(endpoint, set())
    assert params == []
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    assert validate_batch_file(str(path), _models()).line_count == 1


def test_an_unknown_model_and_a_bad_max_tokens_are_both_reported(tmp_path: Any) -> None:
    line, params = build("chat", {("body", "model"), ("body", "max_tokens")})
    assert params == ["body.model", "body.max_tokens"]
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(InvalidBatchFile) as raised:
        validate_batch_file(str(path), _models())
    assert [problem.message.split(" ")[0] for problem in raised.value.problems] == [
        "'body.model'",
        "'body.max_tokens'",
    ]


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_a_duplicate_custom_id_is_reported_beside_the_lines_other_problems(
    tmp_path: Any, endpoint: str
) -> None:
    """A later line's duplicate ``custom_id`` is an envelope problem: it comes before the body's
    (the model's among them), as every envelope problem does."""
    first, _ = build(endpoint, set())
    body_kinds = [kind for kind in kinds_of(endpoint) if kind[0] != "env"]
    second, params = build(endpoint, {("body", "model"), *body_kinds[-2:]})
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    with pytest.raises(InvalidBatchFile) as raised:
        validate_batch_file(str(path), _models())
    messages = [problem.message for problem in raised.value.problems]
    assert all(problem.line == 2 for problem in raised.value.problems)
    assert messages[0] == "duplicate custom_id 'a'" and len(messages) == len(params) + 1, messages
    for message, param in zip(messages[1:], params, strict=True):
        assert f"'{param}" in message, (param, messages)
