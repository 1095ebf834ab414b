"""No request makes a 500: schemathesis over the OpenAPI schema the server publishes
(``/schema/openapi.json``), in its positive and negative modes, and Hypothesis over the JSON body
of ``POST /v1/batches`` (which the schema leaves open), against the in-process app and against a
live ``batchgen-server`` process on 127.0.0.1, each without keys and with a key present. With a
key present, calls are sent with the key, without one, or with a wrong one, and on the path as
the schema spells it or spelt oddly (``//``, an encoded ``/``): none is a 500, and none without a
valid key, or on an odd spelling, is a 2xx (but ``/health``, which is open)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from batchgen.server.api_keys import KeyStore
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import chat_line, jsonl, upload
from tests.live import LiveServer, start_server

pytestmark = pytest.mark.fuzz  # runs in nox -s tests, not in the fast unit loop


def _make_key(storage: Any) -> str:
    storage.mkdir(parents=True, exist_ok=True)
    store = KeyStore(storage / "metadata.sqlite3")
    try:
        return store.create_key("fuzzer")[1]
    finally:
        store.close()


@pytest.fixture(scope="module")
def keyed_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """An in-process app with a key present; the client sends that key unless told otherwise."""
    storage = tmp_path_factory.mktemp("keyed") / "storage"
    key = _make_key(storage)
    with TestClient(in_process_app(storage), timeout=30) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        yield client


@pytest.fixture(scope="module")
def keyed_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A live server with a key present; the client sends that key unless told otherwise."""
    storage = tmp_path_factory.mktemp("keyed-live") / "storage"
    key = _make_key(storage)
    live = start_server(storage)
    try:
        with httpx.Client(
            base_url=live.base_url, timeout=30, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            yield client
    finally:
        live.stop()


@pytest.fixture(
    params=[
        "in-process",
        "in-process-keys",
        pytest.param("live", marks=pytest.mark.live),
        pytest.param("live-keys", marks=pytest.mark.live),
    ]
)
def server(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    """The in-process app (``api``), a client of a live server process (``live_server``), or
    either with a key present (the client then sends the key by default)."""
    if request.param == "in-process":
        yield request.getfixturevalue("api")
        return
    if request.param == "in-process-keys":
        yield request.getfixturevalue("keyed_api")
        return
    if request.param == "live-keys":
        yield request.getfixturevalue("keyed_live")
        return
    live: LiveServer = request.getfixturevalue("live_server")
    with httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client


#: How a fuzzed call presents itself when a key exists: as the client does (the key), or not.
_CREDENTIALS = st.sampled_from(["key", "none", "wrong", "malformed"])
_WRONG = {"wrong": "Bearer bg-000000000000-" + "0" * 64, "malformed": "Bearer x"}
#: Odd spellings of a path that httpx sends as they are.
_SPELLINGS = st.sampled_from(
    [
        lambda path: path,
        lambda path: "/" + path,
        lambda path: path.replace("/", "//", 2),
        lambda path: "/%2F" + path.lstrip("/"),
        lambda path: path.replace("/v1/", "/v1%2F", 1),
    ]
)


def _odd_url(url: str, spelling: Any) -> httpx.URL:
    parsed = httpx.URL(url)
    spelt = spelling(parsed.raw_path.decode("ascii").split("?")[0])
    return parsed.copy_with(raw_path=spelt.encode("ascii") + (b"?" + parsed.query if parsed.query else b""))


def _schema(api: httpx.Client) -> Any:
    response = api.get("/schema/openapi.json")
    assert response.status_code == 200
    return schemathesis.openapi.from_dict(response.json())


@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_request_the_schema_allows_or_forbids_is_a_500(server: httpx.Client, data: st.DataObject) -> None:
    api = server
    schema = _schema(api)
    operation = data.draw(st.sampled_from([result.ok() for result in schema.get_all_operations()]))
    mode = data.draw(st.sampled_from(["positive", "negative"]))
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    case = data.draw(strategy)
    kwargs = case.as_transport_kwargs(base_url=str(api.base_url))
    headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "content-length"}
    keyed = "authorization" in {name.lower() for name in api.headers}
    credentials = data.draw(_CREDENTIALS) if keyed else "none"
    if credentials in _WRONG:
        headers["Authorization"] = _WRONG[credentials]
    elif credentials == "none" and keyed:
        headers["Authorization"] = ""  # an empty header: no key
    spelling = data.draw(_SPELLINGS)
    url = _odd_url(kwargs["url"], spelling)
    response = api.request(
        kwargs["method"],
        url,
        params=kwargs.get("params"),
        headers=headers,
        content=kwargs.get("data") if isinstance(kwargs.get("data"), bytes | str) else None,
        json=kwargs.get("json"),
    )
    assert response.status_code < 500, (case.as_curl_command(), response.text)
    odd = url.raw_path.split(b"?")[0] != httpx.URL(kwargs["url"]).raw_path.split(b"?")[0]
    if odd or (keyed and credentials != "key" and operation.path != "/health"):
        assert not 200 <= response.status_code < 300, (str(url), credentials, response.status_code)


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


@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
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
