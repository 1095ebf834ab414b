"""No request makes a 500: schemathesis over the OpenAPI schema the server publishes
(``/schema/openapi.json``), in its positive and negative modes, and Hypothesis over the JSON body
of ``POST /v1/batches`` (which the schema leaves open), against the in-process app and against a
live ``batchgen-server`` process on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import chat_line, jsonl, upload
from tests.live import LiveServer

pytestmark = pytest.mark.fuzz  # runs in nox -s tests, not in the fast unit loop


@pytest.fixture(params=["in-process", pytest.param("live", marks=pytest.mark.live)])
def server(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    """The in-process app (``api``), or a client of a live server process (``live_server``)."""
    if request.param == "in-process":
        yield request.getfixturevalue("api")
        return
    live: LiveServer = request.getfixturevalue("live_server")
    with httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client


def _schema(api: httpx.Client) -> Any:
    response = api.get("/schema/openapi.json")
    assert response.status_code == 200
    return schemathesis.openapi.from_dict(response.json())


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_request_the_schema_allows_or_forbids_is_a_500(server: httpx.Client, data: st.DataObject) -> None:
    api = server
    schema = _schema(api)
    operation = data.draw(st.sampled_from([result.ok() for result in schema.get_all_operations()]))
    mode = data.draw(st.sampled_from(["positive", "negative"]))
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    case = data.draw(strategy)
    kwargs = case.as_transport_kwargs(base_url=str(api.base_url))
    response = api.request(
        kwargs["method"],
        kwargs["url"],
        params=kwargs.get("params"),
        headers={k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "content-length"},
        content=kwargs.get("data") if isinstance(kwargs.get("data"), bytes | str) else None,
        json=kwargs.get("json"),
    )
    assert response.status_code < 500, (case.as_curl_command(), response.text)


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
)
_fields = st.sampled_from(
    [
        "input_file_id",
        "endpoint",
        "completion_window",
        "metadata",
        "output_expires_after",
        "max_decoding_length",
        "temperature",
        "top_p",
        "top_k",
        "other",
    ]
)


class _Deep(int):
    """A depth: the field's value is objects nested this deep (written as text, too deep for json)."""


def _text(value: Any) -> str:
    if isinstance(value, _Deep):
        return '{"k": ' * value + "{}" + "}" * value
    return json.dumps(value)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    changes=st.dictionaries(
        _fields, _json | st.integers(2**60, 2**80) | st.integers(10, 3000).map(_Deep), max_size=3
    )
)
def test_no_create_body_is_a_500(server: httpx.Client, changes: dict[str, Any]) -> None:
    api = server
    file_id = upload(api, jsonl(chat_line("a")))["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", **changes}
    text = "{" + ", ".join(f"{json.dumps(key)}: {_text(value)}" for key, value in body.items()) + "}"
    response = api.post("/v1/batches", content=text, headers={"content-type": "application/json"})
    assert response.status_code in (200, 400, 404, 409, 429), response.text
    if response.status_code == 400:
        assert response.json()["error"]["message"]
