"""Structured output, logprobs and several choices with the real SmolLM2 model behind the REST API.

Every output of a ``json_schema`` batch parses and validates against its schema (``jsonschema``);
``json_object`` outputs are JSON objects; a line cut off by ``max_tokens`` ends with ``length``; a
schema that cannot be compiled is that line's error line while the other lines complete; ``n: 3``
gives three choices counted together; logprobs come in OpenAI's shapes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests import packaged_model
from tests.close_floats import close_json
from tests.helpers import chat_line, completion_line, file_lines, submit, wait_for_status
from tests.live import LiveServer, start_server

pytestmark = [pytest.mark.model, pytest.mark.live]

#: The converted model, kept between runs (git-ignored).

SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": (
        "Describe a famous scientist.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
        },
    ),
    "distance": (
        "How far is it from Paris to Rome?",
        {
            "type": "object",
            "properties": {"value": {"type": "number"}, "unit": {"enum": ["km", "miles"]}},
            "required": ["value", "unit"],
        },
    ),
    "tags": (
        "Give tags for a blog post about baking bread.",
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                "public": {"type": "boolean"},
            },
            "required": ["tags", "public"],
        },
    ),
    "nested": (
        "Describe a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "location": {
                    "type": "object",
                    "properties": {
                        "country": {"type": "string", "maxLength": 30},
                        "coastal": {"type": "boolean"},
                    },
                    "required": ["country", "coastal"],
                },
            },
            "required": ["city", "location"],
        },
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = packaged_model.converted()
    storage = tmp_path_factory.mktemp("structured") / "storage"
    server = start_server(storage, "--backend", "transformers", "--model", str(folder), timeout_s=600)
    yield server
    server.stop()


def _run(server: LiveServer, lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        batch = wait_for_status(client, submit(client, lines)["id"], {"completed", "failed"}, timeout_s=600)
        assert batch["status"] == "completed", batch
        output = file_lines(client, batch["output_file_id"]) + file_lines(client, batch["error_file_id"])
    return {line["custom_id"]: line for line in output}


def _validate(value: Any, schema: dict[str, Any]) -> None:
    import jsonschema  # a tests-session dependency (the unit session collects this module without it)

    jsonschema.validate(value, schema)


def _schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_a_json_schema_batch_validates_against_its_schemas(server: LiveServer) -> None:
    lines = [
        chat_line(name, question, max_tokens=160, response_format=_schema_format(name, schema))
        for name, (question, schema) in SCHEMAS.items()
    ]
    lines += [
        chat_line(
            f"sampled-{name}",
            question,
            max_tokens=160,
            temperature=0.8,
            seed=4,
            n=2,
            response_format=_schema_format(name, schema),
        )
        for name, (question, schema) in SCHEMAS.items()
    ]
    lines += [
        chat_line(
            f"object-{index}",
            f"Return a JSON object with the keys {keys} for {thing}.",
            max_tokens=200,
            response_format={"type": "json_object"},
        )
        for index, (keys, thing) in enumerate(
            [
                ('"name" and "colour"', "a cat"),
                ('"make" and "year"', "a car"),
                ('"city" and "sunny"', "today"),
            ]
        )
    ]
    bad_schema = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
    lines.append(chat_line("bad", "Hello", max_tokens=20, response_format=_schema_format("bad", bad_schema)))
    lines.append(
        chat_line(
            "cut",
            "Describe a famous scientist.",
            max_tokens=4,
            response_format=_schema_format("person", SCHEMAS["person"][1]),
        )
    )
    results = _run(server, lines)
    assert len(results) == len(lines)

    for name, (_, schema) in SCHEMAS.items():
        for custom_id in (name, f"sampled-{name}"):
            body = results[custom_id]["response"]["body"]
            assert len(body["choices"]) == (1 if custom_id == name else 2)
            for choice in body["choices"]:
                assert choice["finish_reason"] == "stop", choice
                _validate(json.loads(choice["message"]["content"]), schema)
    for index in range(3):
        choice = results[f"object-{index}"]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict)

    bad = results["bad"]
    assert bad["response"] is None and bad["error"]["code"] == "invalid_request"
    assert "response_format" in bad["error"]["message"]
    cut = results["cut"]["response"]["body"]
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 4
    assert cut["choices"][0]["message"]["content"].startswith("{")


def test_n_and_logprobs_in_openai_shapes(server: LiveServer) -> None:
    results = _run(
        server,
        [
            chat_line("three", "Write a short poem line.", max_tokens=12, temperature=1.0, seed=9, n=3),
            chat_line("one", "Write a short poem line.", max_tokens=12),
            chat_line("logprobs", "What is 2+2?", max_tokens=10, logprobs=True, top_logprobs=4),
        ],
    )
    results.update(
        _run(server, [completion_line("legacy", "The capital of France is", max_tokens=5, logprobs=2, n=2)])
    )
    three = results["three"]["response"]["body"]
    assert [choice["index"] for choice in three["choices"]] == [0, 1, 2]
    texts = [choice["message"]["content"] for choice in three["choices"]]
    assert len(set(texts)) > 1, texts
    one = results["one"]["response"]["body"]
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"], "the prompt is counted once"
    assert three["usage"]["completion_tokens"] <= 3 * 12
    assert (
        three["usage"]["total_tokens"]
        == three["usage"]["prompt_tokens"] + three["usage"]["completion_tokens"]
    )

    choice = results["logprobs"]["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert content and "".join(entry["token"] for entry in content) == choice["message"]["content"]
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 4 and entry["logprob"] <= 0
        assert math.isclose(entry["logprob"], top[0]["logprob"], abs_tol=1e-4), "greedy: the most likely"
        assert sum(math.exp(item["logprob"]) for item in top) <= 1 + 1e-4

    legacy = results["legacy"]["response"]["body"]
    assert [choice["index"] for choice in legacy["choices"]] == [0, 1]
    # greedy choices are the same tokens; their logprobs, computed in two batch rows, agree only
    # within a tolerance (the last bits differ, by how much depends on the CPU's dtype)
    first, second = legacy["choices"]
    assert first["text"] == second["text"] and first["logprobs"]["tokens"] == second["logprobs"]["tokens"]
    assert not close_json(first, {**second, "index": 0}), close_json(first, {**second, "index": 0})
    logprobs = legacy["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == legacy["choices"][0]["text"]
    assert logprobs["text_offset"][0] == len("The capital of France is")
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    # The end-of-sequence token, when one ended the answer, is counted but not listed.
    assert legacy["usage"]["completion_tokens"] in (
        2 * len(logprobs["tokens"]),
        2 * len(logprobs["tokens"]) + 2,
    )


def test_a_responses_line_with_a_json_schema_text_format(server: LiveServer) -> None:
    question, schema = SCHEMAS["distance"]
    line = {
        "custom_id": "resp",
        "method": "POST",
        "url": "/v1/responses",
        "body": {
            "model": "default",
            "input": question,
            "max_output_tokens": 120,
            "text": {"format": {"type": "json_schema", "name": "distance", "schema": schema, "strict": True}},
        },
    }
    body = _run(server, [line])["resp"]["response"]["body"]
    assert body["status"] == "completed", body
    _validate(json.loads(body["output_text"]), schema)
