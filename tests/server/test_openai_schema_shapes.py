"""Everything the server writes validates against OpenAI's published schema (``tests/openai_schema``):
every output and error line of chat, completions and Responses batches (both error-file
conventions), the bodies in them, the Files and Batches objects and lists, the model list, and
error bodies.

The simulated backend answers here; ``test_transformers_model`` checks the real model's lines
(logprobs, several choices, embeddings) against the same schema. Hypothesis varies the lines'
bodies, so every field that changes what a line holds (stop, limits, sampling, Responses
instructions and input items) is covered.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.models import GenerationResult
from batchgen.core.requests.results import output_line
from tests.examples import examples
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    TERMINAL,
    ApiFactory,
    chat_line,
    completion_line,
    file_lines,
    jsonl,
    post_file,
    submit,
    upload,
    wait_for_status,
)
from tests.openai_schema import openai_shape_errors, result_line_errors

RESPONSES = "/v1/responses"
_FUZZ = settings(
    max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _valid(component: str, instance: Any) -> None:
    problems = openai_shape_errors(component, instance)
    assert not problems, (component, problems, instance)


def _run_lines(
    client: httpx.Client, lines: list[dict[str, Any]], **extra: object
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    batch = submit(client, lines, **extra)
    _valid("Batch", batch)
    done = wait_for_status(client, batch["id"], TERMINAL)
    _valid("Batch", done)
    written = file_lines(client, done["output_file_id"]) + file_lines(client, done["error_file_id"])
    assert len(written) == len(lines), written
    endpoint = str(lines[0]["url"])
    for line in written:
        problems = result_line_errors(line, endpoint)
        assert not problems, (problems, line)
    return done, written


def _responses_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": RESPONSES, "body": body}


_limits = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 60),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.sampled_from(["the", ["a", "b"], [], "\n"]),
    },
)
_text = st.text(min_size=1, max_size=40)


@given(bodies=st.lists(_limits, min_size=1, max_size=4), content=_text)
@_FUZZ
def test_chat_lines_validate(api: httpx.Client, bodies: list[dict[str, Any]], content: str) -> None:
    lines = [chat_line(f"c{index}", content, **body) for index, body in enumerate(bodies)]
    _, written = _run_lines(api, lines)
    for line in written:
        if line["response"] is not None:
            assert all(choice["message"]["refusal"] is None for choice in line["response"]["body"]["choices"])


@given(bodies=st.lists(_limits, min_size=1, max_size=4), prompt=st.text(max_size=40))
@_FUZZ
def test_completion_lines_validate(api: httpx.Client, bodies: list[dict[str, Any]], prompt: str) -> None:
    lines = [completion_line(f"p{index}", prompt, **body) for index, body in enumerate(bodies)]
    _run_lines(api, lines)


_input_items = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "developer", "assistant"]),
            "content": _text | st.just([{"type": "input_text", "text": "Hi"}]),
        },
        optional={"type": st.just("message")},
    ),
    min_size=1,
    max_size=3,
)


@given(
    inputs=st.lists(_text | _input_items, min_size=1, max_size=3),
    instructions=st.none() | _text,
    limit=st.none() | st.integers(1, 40),
)
@_FUZZ
def test_responses_lines_validate(
    api: httpx.Client, inputs: list[Any], instructions: str | None, limit: int | None
) -> None:
    lines = [
        _responses_line(
            f"r{index}", {"input": value, "instructions": instructions, "max_output_tokens": limit}
        )
        for index, value in enumerate(inputs)
    ]
    _, written = _run_lines(api, lines)
    for line in written:
        body = line["response"]["body"]
        part = body["output"][0]["content"][0]
        assert part["logprobs"] == [] and body["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


@pytest.mark.parametrize("convention", ["output", "openai"])
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, RESPONSES])
def test_error_lines_validate(api_factory: ApiFactory, convention: str, endpoint: str) -> None:
    """Lines over the context (context_length_exceeded) and lines failing every attempt
    (backend_error), in the output file or OpenAI's separate error file."""
    client = api_factory(
        "--error-file",
        convention,
        "--max-context-length",
        "8",
        "--simulated-failure-rate",
        "0.5",
        storage=f"{convention}{endpoint.replace('/', '-')}",
    )
    long = " ".join(["word"] * 40)
    lines: list[dict[str, Any]] = []
    for index in range(12):
        text = long if index % 2 else "Hi"
        if endpoint == CHAT:
            lines.append(chat_line(f"l{index}", text))
        elif endpoint == COMPLETIONS:
            lines.append(completion_line(f"l{index}", text))
        else:
            lines.append(_responses_line(f"l{index}", {"input": text}))
    done, written = _run_lines(client, lines)
    assert any(line["error"] is not None for line in written)
    if convention == "openai":
        assert done["error_file_id"] is not None


def test_files_and_batches_objects_validate(api_factory: ApiFactory) -> None:
    api = api_factory("--simulated-latency-s", "2")  # so that the cancel finds the batch running
    created = upload(api, jsonl(chat_line("a"), chat_line("b")))
    _valid("OpenAIFile", created)
    _valid("OpenAIFile", api.get(f"/v1/files/{created['id']}").json())
    _valid("ListFilesResponse", api.get("/v1/files").json())
    _valid("ListFilesResponse", api.get("/v1/files", params={"purpose": "nothing-has-this"}).json())
    batch = api.post("/v1/batches", json={"input_file_id": created["id"], "endpoint": CHAT}).json()
    _valid("Batch", batch)
    _valid("Batch", api.post(f"/v1/batches/{batch['id']}/cancel").json())
    ended = wait_for_status(api, batch["id"], TERMINAL)
    _valid("Batch", ended)
    _valid("ListBatchesResponse", api.get("/v1/batches").json())
    _valid("ListBatchesResponse", api.get("/v1/batches", params={"after": ended["id"], "limit": 1}).json())
    spare = upload(api, jsonl(chat_line("c")))
    _valid("DeleteFileResponse", api.delete(f"/v1/files/{spare['id']}").json())


def test_the_model_list_validates(api: httpx.Client) -> None:
    listed = api.get("/v1/models").json()
    _valid("ListModelsResponse", listed)
    for entry in listed["data"]:
        _valid("Model", api.get(f"/v1/models/{entry['id']}").json())


def test_a_failed_batch_validates(api_factory: ApiFactory) -> None:
    client = api_factory("--max-intake-capacity", "1")
    batch = submit(client, [chat_line("a"), chat_line("b")])
    failed = wait_for_status(client, batch["id"], {"failed"})
    _valid("Batch", failed)


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("GET", "/v1/files/file-nope", {}),
        ("GET", "/v1/batches/batch_nope", {}),
        ("POST", "/v1/batches", {"json": {"input_file_id": "file-nope", "endpoint": "/v1/nope"}}),
        ("POST", "/v1/batches", {"content": b"not json"}),
        ("GET", "/v1/batches", {"params": {"limit": "x"}}),
        ("POST", "/v1/files", {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "batch"}}),
    ],
)
def test_error_bodies_validate(api: httpx.Client, method: str, path: str, kwargs: dict[str, Any]) -> None:
    response = api.request(method, path, **kwargs)
    assert 400 <= response.status_code < 500
    _valid("ErrorResponse", response.json())


def test_an_upload_refused_for_bad_lines_validates(api: httpx.Client) -> None:
    response = post_file(api, jsonl(chat_line("a", max_tokens=0)))
    assert response.status_code == 400
    _valid("ErrorResponse", response.json())


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_backend_choices_get_the_refusal_fields(with_logprobs: bool) -> None:
    """A backend's own choices (several, with logprobs: the transformers backend's shape, without
    the refusal fields) are written with them."""
    entry = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    choices = tuple(
        {
            "index": index,
            "message": {"role": "assistant", "content": "Hi"},
            "logprobs": {"content": [entry]} if with_logprobs else None,
            "finish_reason": "stop",
        }
        for index in range(2)
    )
    result = GenerationResult("Hi", "stop", 3, 2, choices=choices)
    line = json.loads(output_line("c", "req_1", CHAT, "m", result, 1))
    assert not result_line_errors(line, CHAT), result_line_errors(line, CHAT)
    completion = {"index": 0, "text": "Hi", "logprobs": None, "finish_reason": "length"}
    legacy = json.loads(
        output_line(
            "p", "req_2", COMPLETIONS, "m", GenerationResult("Hi", "length", 1, 1, choices=(completion,)), 1
        )
    )
    assert not result_line_errors(legacy, COMPLETIONS)
