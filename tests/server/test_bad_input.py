"""Bad input gets a clear OpenAI-shaped 4xx naming the problem, and the server stays healthy."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.live import LiveServer, chat_line


@pytest.fixture(scope="module")
def http(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.base_url, timeout=30) as client:
        yield client


@pytest.fixture(autouse=True)
def _server_stays_healthy(http: httpx.Client) -> Iterator[None]:
    yield
    assert http.get("/health").json() == {"status": "healthy"}


def _jsonl(*lines: object) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def _upload(http: httpx.Client, content: bytes, purpose: str = "batch") -> httpx.Response:
    return http.post("/v1/files", files={"file": ("input.jsonl", content)}, data={"purpose": purpose})


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def _file_count(http: httpx.Client) -> int:
    return len(http.get("/v1/files").json()["data"])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"this is not json\n", "line 1: not valid JSON"),
        (_jsonl(chat_line("a")) + b"\xff\xfe{}\n", "line 2: not valid UTF-8"),
        (_jsonl(chat_line("a"), [1, 2]), "line 2: a line must be a JSON object"),
        (
            _jsonl({k: v for k, v in chat_line("a").items() if k != "custom_id"}),
            "line 1: missing 'custom_id'",
        ),
        (
            _jsonl(chat_line("same"), chat_line("other"), chat_line("same")),
            "line 3: duplicate custom_id 'same'",
        ),
        (_jsonl({**chat_line("a"), "method": "GET"}), "line 1: 'method' must be \"POST\""),
        (_jsonl({**chat_line("a"), "url": "/v1/embeddings"}), "line 1: 'url' must be one of"),
        (
            _jsonl(
                chat_line("a"),
                {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
            ),
            "line 2: 'url' '/v1/completions' differs",
        ),
        (_jsonl({**chat_line("a"), "body": "hello"}), "line 1: 'body' must be a JSON object"),
        (_jsonl({**chat_line("a"), "body": {"messages": []}}), "'body.messages' must be a non-empty list"),
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
    http: httpx.Client, content: bytes, expected: str
) -> None:
    before = _file_count(http)
    error = _error(_upload(http, content), 400)
    assert expected in str(error["message"])
    assert error["code"] == "invalid_batch_file"
    assert _file_count(http) == before, "a rejected file must not be stored"


def test_many_problems_are_summarised(http: httpx.Client) -> None:
    content = b"".join(b"nope\n" for _ in range(25))
    message = str(_error(_upload(http, content), 400)["message"])
    assert "line 1:" in message and "line 10:" in message and "line 11:" not in message
    assert "(and 15 more)" in message


def test_oversized_upload_is_413(server_factory, tmp_path) -> None:
    server = server_factory("--max-upload-bytes", "2000", storage="small")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        near = _jsonl(*[chat_line(f"r{i}") for i in range(30)])  # a few KB: refused while streaming
        assert len(near) > 2000
        _error(client.post("/v1/files", files={"file": ("in.jsonl", near)}, data={"purpose": "batch"}), 413)
        huge = near * 200  # far over: refused from Content-Length
        _error(client.post("/v1/files", files={"file": ("in.jsonl", huge)}, data={"purpose": "batch"}), 413)
        assert client.get("/v1/files").json()["data"] == []
        assert list((server.storage_path / "staging").iterdir()) == []
        ok = _jsonl(chat_line("fits"))
        assert (
            client.post("/v1/files", files={"file": ("in.jsonl", ok)}, data={"purpose": "batch"}).status_code
            == 200
        )


@pytest.mark.parametrize(
    ("request_kwargs", "expected"),
    [
        ({"files": {"purpose": (None, "batch")}}, "no 'file' part"),
        ({"files": {"file": ("in.jsonl", _jsonl(chat_line("a")))}}, "'purpose' is required"),
        (
            {"files": {"file": ("in.jsonl", _jsonl(chat_line("a")))}, "data": {"purpose": "bogus"}},
            "purpose must be one of",
        ),
        ({"content": b"{}", "headers": {"content-type": "application/json"}}, "multipart/form-data"),
    ],
    ids=["no-file", "no-purpose", "bad-purpose", "not-multipart"],
)
def test_malformed_uploads(http: httpx.Client, request_kwargs: dict, expected: str) -> None:
    assert expected in str(_error(http.post("/v1/files", **request_kwargs), 400)["message"])


def test_unknown_ids_are_404(http: httpx.Client) -> None:
    for method, path in [
        ("GET", "/v1/files/file-missing"),
        ("DELETE", "/v1/files/file-missing"),
        ("GET", "/v1/files/file-missing/content"),
        ("GET", "/v1/batches/batch_missing"),
        ("POST", "/v1/batches/batch_missing/cancel"),
    ]:
        error = _error(http.request(method, path), 404)
        assert "missing" in str(error["message"])


@pytest.fixture(scope="module")
def chat_file_id(http: httpx.Client) -> str:
    return str(_upload(http, _jsonl(chat_line("a"), chat_line("b"))).json()["id"])


@pytest.mark.parametrize(
    ("body", "expected", "param"),
    [
        (b"not json", "not valid JSON", None),
        (b"[1, 2]", "must be a JSON object", None),
        (b"{}", "'input_file_id' is required", "input_file_id"),
        (
            {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions"},
            "No file with id 'file-nope'",
            "input_file_id",
        ),
        ({"endpoint": "/v1/embeddings"}, "endpoint must be one of", "endpoint"),
        ({"endpoint": "/v1/completions"}, "requests use '/v1/chat/completions'", "endpoint"),
        ({"completion_window": "tomorrow"}, "completion_window must look like", "completion_window"),
        ({"metadata": {"k": 1}}, "metadata keys", "metadata"),
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
        "unknown-file",
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
    http: httpx.Client, chat_file_id: str, body: object, expected: str, param: str | None
) -> None:
    if isinstance(body, dict):
        body = {"input_file_id": chat_file_id, "endpoint": "/v1/chat/completions", **body}
        response = http.post("/v1/batches", json=body)
    else:
        response = http.post("/v1/batches", content=body, headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert expected in str(error["message"])
    assert error["param"] == param


def test_batch_on_a_non_batch_file_is_400(http: httpx.Client) -> None:
    file_id = _upload(http, b"anything at all", purpose="user_data").json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    assert "purpose 'user_data'" in str(_error(http.post("/v1/batches", json=body), 400)["message"])


def test_bad_list_parameters(http: httpx.Client) -> None:
    assert "limit" in str(_error(http.get("/v1/batches", params={"limit": 101}), 400)["message"])
    assert "limit" in str(_error(http.get("/v1/batches", params={"limit": "abc"}), 400)["message"])
    assert "order" in str(_error(http.get("/v1/files", params={"order": "sideways"}), 400)["message"])


def test_cancel_of_a_finished_batch_is_409(http: httpx.Client) -> None:
    file_id = _upload(http, _jsonl(chat_line("only"))).json()["id"]
    batch = http.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    ).json()
    for _ in range(200):
        if http.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed":
            break
    assert "completed" in str(_error(http.post(f"/v1/batches/{batch['id']}/cancel"), 409)["message"])
