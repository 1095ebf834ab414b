"""Bad input gets a clear OpenAI-shaped 4xx naming the problem, and the server stays healthy.

The real app runs in this process (Litestar's test client) over real SQLite and files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from batchgen.core.files.batch_file import MAX_LINE_PROBLEMS
from tests.core.test_line_problems_every_endpoint import build, lines
from tests.examples import examples
from tests.helpers import (
    ApiFactory,
    api_error,
    chat_line,
    create_batch,
    jsonl,
    post_file,
    upload,
    wait_for_status,
)
from tests.live import free_port


@pytest.fixture(autouse=True)
def _server_stays_healthy(api: httpx.Client) -> Iterator[None]:
    yield
    assert api.get("/health").json() == {"status": "healthy"}


def _file_count(api: httpx.Client) -> int:
    return len(api.get("/v1/files").json()["data"])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"this is not json\n", "line 1: not valid JSON"),
        (jsonl(chat_line("a")) + b"\xff\xfe{}\n", "line 2: not valid UTF-8"),
        (jsonl(chat_line("a"), [1, 2]), "line 2: a line must be a JSON object"),
        (
            jsonl({k: v for k, v in chat_line("a").items() if k != "custom_id"}),
            "line 1: missing 'custom_id'",
        ),
        (
            jsonl(chat_line("same"), chat_line("other"), chat_line("same")),
            "line 3: duplicate custom_id 'same'",
        ),
        (jsonl({**chat_line("a"), "method": "GET"}), "line 1: 'method' must be \"POST\""),
        (jsonl({**chat_line("a"), "url": "/v1/audio/speech"}), "line 1: 'url' must be one of"),
        (
            jsonl(
                chat_line("a"),
                {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
            ),
            "line 2: 'url' '/v1/completions' differs",
        ),
        (jsonl({**chat_line("a"), "body": "hello"}), "line 1: 'body' must be a JSON object"),
        (jsonl({**chat_line("a"), "body": {"messages": []}}), "'body.messages' must be a non-empty list"),
        (b"", "the file contains no requests"),
        (b"\n  \n", "the file contains no requests"),
    ],
    ids=[
        "not-json",
        "not-utf8",
        "not-object",
        "missing-custom-id",
        "duplicate-custom-id",
        "wrong-method",
        "unknown-url",
        "mixed-urls",
        "body-not-object",
        "empty-messages",
        "empty-file",
        "blank-file",
    ],
)
def test_invalid_batch_file_is_rejected_with_line_numbers(
    api: httpx.Client, content: bytes, expected: str
) -> None:
    before = _file_count(api)
    error = api_error(post_file(api, content), 400)
    assert expected in str(error["message"])
    assert error["code"] == "invalid_batch_file"
    assert _file_count(api) == before, "a rejected file must not be stored"


def test_many_problems_are_summarised(api: httpx.Client) -> None:
    content = b"".join(b"nope\n" for _ in range(25))
    message = str(api_error(post_file(api, content), 400)["message"])
    assert "line 1:" in message and "line 10:" in message and "line 11:" not in message
    assert "(and 15 more)" in message


def test_every_problem_of_a_line_is_reported_in_field_order(api: httpx.Client) -> None:
    bad = {**chat_line("a", max_tokens=0, temperature=9, seed="x"), "method": "GET"}
    bad["body"]["messages"].append({"content": "no role"})
    error = api_error(post_file(api, jsonl(chat_line("ok"), bad)), 400)
    message = str(error["message"])
    assert error["code"] == "invalid_batch_file" and error["param"] == "file"
    fields = ["'method'", "'body.messages[1].role'", "'body.max_tokens'", "'body.temperature'", "'body.seed'"]
    entries = message.removeprefix("Invalid batch input file: ").split("; ")
    assert len(entries) == len(fields)
    for entry, field in zip(entries, fields, strict=True):
        assert entry.startswith(f"line 2: {field}") or entry.startswith(f"line 2: missing {field}")


def test_oversized_upload_is_413(api_factory: ApiFactory, tmp_path: Path) -> None:
    client = api_factory("--max-upload-bytes", "2000", storage="small")
    near = jsonl(*[chat_line(f"r{i}") for i in range(30)])  # a few KB: refused while streaming
    assert len(near) > 2000
    api_error(client.post("/v1/files", files={"file": ("in.jsonl", near)}, data={"purpose": "batch"}), 413)
    huge = near * 200  # far over: refused from Content-Length
    api_error(client.post("/v1/files", files={"file": ("in.jsonl", huge)}, data={"purpose": "batch"}), 413)
    assert client.get("/v1/files").json()["data"] == []
    assert list((tmp_path / "small" / "staging").iterdir()) == []
    ok = jsonl(chat_line("fits"))
    assert (
        client.post("/v1/files", files={"file": ("in.jsonl", ok)}, data={"purpose": "batch"}).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("request_kwargs", "expected"),
    [
        ({"files": {"purpose": (None, "batch")}}, "no 'file' part"),
        ({"files": {"file": ("in.jsonl", jsonl(chat_line("a")))}}, "'purpose' is required"),
        (
            {"files": {"file": ("in.jsonl", jsonl(chat_line("a")))}, "data": {"purpose": "bogus"}},
            "purpose must be one of",
        ),
        ({"content": b"{}", "headers": {"content-type": "application/json"}}, "multipart/form-data"),
    ],
    ids=["no-file", "no-purpose", "bad-purpose", "not-multipart"],
)
def test_malformed_uploads(api: httpx.Client, request_kwargs: dict, expected: str) -> None:
    assert expected in str(api_error(api.post("/v1/files", **request_kwargs), 400)["message"])


def test_unknown_ids_are_404(api: httpx.Client) -> None:
    for method, path in [
        ("GET", "/v1/files/file-missing"),
        ("DELETE", "/v1/files/file-missing"),
        ("GET", "/v1/files/file-missing/content"),
        ("GET", "/v1/batches/batch_missing"),
        ("POST", "/v1/batches/batch_missing/cancel"),
    ]:
        error = api_error(api.request(method, path), 404)
        assert "missing" in str(error["message"])


@pytest.fixture(scope="module")
def chat_file_id(api: httpx.Client) -> str:
    return str(upload(api, jsonl(chat_line("a"), chat_line("b")))["id"])


@pytest.mark.parametrize(
    ("body", "expected", "param"),
    [
        (b"not json", "not valid JSON", None),
        (b"[1, 2]", "must be a JSON object", None),
        (b"{}", "'input_file_id' is required", "input_file_id"),
        ({"endpoint": "/v1/audio/speech"}, "endpoint must be one of", "endpoint"),
        ({"endpoint": "/v1/completions"}, "requests use '/v1/chat/completions'", "endpoint"),
        ({"completion_window": "tomorrow"}, "completion_window must look like", "completion_window"),
        ({"metadata": {"k": 1}}, "metadata.k must be a string", "metadata.k"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16 pairs", "metadata"),
        ({"temperature": 5}, "temperature must be between 0 and 2", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1]", "top_p"),
        ({"max_decoding_length": 0}, "max_decoding_length must be at least 1", "max_decoding_length"),
        ({"max_decoding_length": "many"}, "max_decoding_length must be at least 1", "max_decoding_length"),
        ({"surprise": True}, "Unknown field(s): surprise", "surprise"),
    ],
    ids=[
        "not-json",
        "not-object",
        "empty",
        "unsupported-endpoint",
        "endpoint-mismatch",
        "bad-window",
        "bad-metadata-value",
        "too-much-metadata",
        "bad-temperature",
        "bad-top-p",
        "bad-max-decoding",
        "string-max-decoding",
        "unknown-field",
    ],
)
def test_malformed_create_batch(
    api: httpx.Client, chat_file_id: str, body: dict[str, object] | bytes, expected: str, param: str | None
) -> None:
    if isinstance(body, dict):
        full = {"input_file_id": chat_file_id, "endpoint": "/v1/chat/completions", **body}
        response = api.post("/v1/batches", json=full)
    else:
        response = api.post("/v1/batches", content=body, headers={"content-type": "application/json"})
    error = api_error(response, 400)
    assert expected in str(error["message"])
    assert error["param"] == param


def test_batch_on_an_unknown_file_is_400_naming_it(api: httpx.Client) -> None:
    """An ``input_file_id`` that names no file the caller may see is bad input (the guide's error
    table, and what OpenAI's clients catch as BadRequest), the same for another tenant's file as
    for one that never existed; the message names the id."""
    body = {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions"}
    error = api_error(api.post("/v1/batches", json=body), 400)
    assert "No file with id 'file-nope'" in str(error["message"])
    assert error["param"] == "input_file_id" and error["type"] == "invalid_request_error"


def test_batch_on_a_non_batch_file_is_400(api: httpx.Client) -> None:
    file_id = upload(api, b"anything at all", purpose="user_data")["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    assert "purpose 'user_data'" in str(api_error(api.post("/v1/batches", json=body), 400)["message"])


def test_bad_list_parameters(api: httpx.Client) -> None:
    assert "limit" in str(api_error(api.get("/v1/batches", params={"limit": 101}), 400)["message"])
    assert "limit" in str(api_error(api.get("/v1/batches", params={"limit": "abc"}), 400)["message"])
    assert "order" in str(api_error(api.get("/v1/files", params={"order": "sideways"}), 400)["message"])


def test_cancel_of_a_finished_batch_is_409(api: httpx.Client) -> None:
    batch = create_batch(api, upload(api, jsonl(chat_line("only")))["id"])
    wait_for_status(api, batch["id"], {"completed"})
    assert "completed" in str(api_error(api.post(f"/v1/batches/{batch['id']}/cancel"), 409)["message"])


def test_every_problem_of_a_line_of_any_endpoint_is_reported_by_the_server(api_factory: ApiFactory) -> None:
    """Through the real app, with the same served models as the core test (a simulated model and
    an openai one whose upstream is down, which serves embeddings): a line of any endpoint with
    several problems, the model's among them, gets a 400 listing each of them in field order, up
    to the bound, with the count of those left out."""
    down = f"http://127.0.0.1:{free_port()}/v1"
    client = api_factory("--model", "sim=simulated", "--model", f"up=openai:upstream={down},upstream-model=m")

    @settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(drawn=lines())
    def check(drawn: tuple[str, set[tuple[str, object]]]) -> None:
        line, params = build(*drawn)
        error = api_error(post_file(client, jsonl(line)), 400)
        assert error["code"] == "invalid_batch_file" and error["param"] == "file"
        message = str(error["message"]).removeprefix("Invalid batch input file: line 1: ")
        entries = message.split("; line 1: ")
        shown = min(len(params), MAX_LINE_PROBLEMS)
        left_out = len(params) - shown
        if left_out:
            assert entries.pop() == f"... and {left_out} more problems on this line"
        assert len(entries) == shown, (params, entries)
        for entry, param in zip(entries, params, strict=False):
            assert f"'{param}" in entry, (param, entries)

    check()
    assert client.get("/v1/files").json()["data"] == []
