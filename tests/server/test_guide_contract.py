"""The user guide is the contract, through the HTTP API, the `openai` SDK and the project's client.

By default: every request has its line in the output file (failed ones too, and ``error_file_id``
stays null); a batch out of time ends ``failed`` (``batch_failed``); creating a batch while the
server is unhealthy is a 503 with ``Retry-After``; a request's ``model`` must be one the server
serves; ``stream: true`` is refused at upload. ``--error-file openai`` is OpenAI's convention.
OpenAI's create field ``output_expires_after`` is accepted and honoured.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar import Litestar
from litestar.testing import TestClient
from openai import OpenAI

from batchgen.client import BatchGenHttpClient, RetriesExhausted, RetryPolicy
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import (
    ApiFactory,
    api_error,
    chat_line,
    create_batch,
    file_lines,
    jsonl,
    post_batch,
    post_file,
    upload,
    wait_for_status,
    write_jsonl,
)
from tests.live import LiveServer

LONG = "word " * 80  # over --max-context-length 40: that request fails with context_length_exceeded
ServerFactory = Callable[..., LiveServer]
SMALL_CONTEXT = ("--max-context-length", "40")


def _mixed(failing: set[int], count: int) -> list[dict[str, object]]:
    return [chat_line(f"r{i}", LONG if i in failing else f"question {i}") for i in range(count)]


# --- every request has its line in the output file ------------------------------------------------
@pytest.mark.parametrize("failing", [{0}, {1, 3}, {0, 1, 2, 3, 4}, set()])
def test_failed_requests_have_their_lines_in_the_output_file(
    api_factory: ApiFactory, failing: set[int]
) -> None:
    client = api_factory(*SMALL_CONTEXT)
    batch = create_batch(client, upload(client, jsonl(*_mixed(failing, 5)))["id"])
    batch = wait_for_status(client, batch["id"], {"completed", "failed"})
    assert batch["status"] == "completed" and batch["error_file_id"] is None
    lines = file_lines(client, batch["output_file_id"])
    assert sorted(line["custom_id"] for line in lines) == [f"r{i}" for i in range(5)]
    for line in lines:
        if int(line["custom_id"][1:]) in failing:
            assert line["response"] is None
            assert line["error"]["code"] == "context_length_exceeded" and line["error"]["message"]
        else:
            assert line["error"] is None and line["response"]["status_code"] == 200
    assert batch["request_counts"] == {"total": 5, "completed": 5 - len(failing), "failed": len(failing)}


def test_openai_switch_writes_failed_requests_to_the_error_file(api_factory: ApiFactory) -> None:
    client = api_factory(*SMALL_CONTEXT, "--error-file", "openai")
    batch = create_batch(client, upload(client, jsonl(*_mixed({1, 3}, 5)))["id"])
    batch = wait_for_status(client, batch["id"], {"completed", "failed"})
    output = file_lines(client, batch["output_file_id"])
    errors = file_lines(client, batch["error_file_id"])
    assert sorted(line["custom_id"] for line in output) == ["r0", "r2", "r4"]
    assert sorted(line["custom_id"] for line in errors) == ["r1", "r3"]
    assert all(line["response"] is None for line in errors)


# --- the model field and streaming, checked at upload ----------------------------------------------
@pytest.fixture(scope="module")
def named_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient[Litestar]]:
    app = in_process_app(
        tmp_path_factory.mktemp("named") / "storage",
        "--served-model-name",
        "team-llm",
        "--served-model-name",
        "gpt-x",
    )
    with TestClient(app, timeout=30) as client:
        yield client


SERVED = ("simulated", "team-llm", "gpt-x", "default")


def test_models_lists_every_name_the_model_answers_to(named_api: httpx.Client) -> None:
    listed = named_api.get("/v1/models").json()
    assert [model["id"] for model in listed["data"]] == ["simulated", "team-llm", "gpt-x"]


def _sdk(client: httpx.Client) -> OpenAI:
    # a TestClient is an httpx.Client: the openai SDK talks to the app in this process
    return OpenAI(
        api_key="unused", base_url="http://testserver/v1", http_client=cast(Any, client), max_retries=0
    )


def test_the_sdk_retrieves_each_listed_model_as_listed(named_api: httpx.Client) -> None:
    listed = named_api.get("/v1/models").json()["data"]
    for entry in listed:
        retrieved = _sdk(named_api).models.retrieve(entry["id"])
        assert retrieved.model_dump(exclude_unset=True) == entry
        assert named_api.head(f"/v1/models/{entry['id']}").status_code == 200


def test_a_model_name_with_slashes_is_retrieved_whole(api_factory: ApiFactory) -> None:
    """By its literal path (the SDK encodes the slash, and an encoded slash is no canonical path)."""
    client = api_factory("--served-model-name", "HuggingFaceTB/SmolLM2-360M-Instruct")
    retrieved = client.get("/v1/models/HuggingFaceTB/SmolLM2-360M-Instruct").json()
    assert retrieved["id"] == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert api_error(client.get("/v1/models/HuggingFaceTB"), 404)["code"] == "model_not_found"


#: What a path segment may not hold (request_paths.py, tests/server/test_route_access.py): a slash, a
#: backslash, a control character, an encoded '%'.
_NAME_CHARACTERS = st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\%")


@settings(
    max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.text(_NAME_CHARACTERS, min_size=1))
def test_a_model_not_served_is_404_model_not_found(named_api: httpx.Client, name: str) -> None:
    if name in SERVED or name in (".", ".."):  # served, or a path segment that is not a name
        return
    response = named_api.get(f"/v1/models/{quote(name, safe='')}")
    error = api_error(response, 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"No model named '{name}'" in error["message"]


@settings(
    max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    models=st.lists(
        st.one_of(st.none(), st.sampled_from(SERVED), st.text(min_size=0, max_size=12)),
        min_size=1,
        max_size=6,
    )
)
def test_a_line_naming_a_model_not_served_is_refused_naming_the_line(
    named_api: httpx.Client, models: list[str | None]
) -> None:
    lines = []
    for i, model in enumerate(models):
        line = chat_line(f"r{i}")
        if model is None:
            del line["body"]["model"]
        else:
            line["body"]["model"] = model
        lines.append(line)
    response = post_file(named_api, jsonl(*lines))
    wrong = [i + 1 for i, model in enumerate(models) if model is not None and model not in SERVED]
    if not wrong:
        assert response.status_code == 200, response.text
        return
    error = api_error(response, 400)
    assert f"line {wrong[0]}:" in error["message"]
    assert all(f"'{name}'" in error["message"] for name in SERVED)


@pytest.mark.parametrize("stream", [True, "true", 1, {}])
def test_a_streaming_request_is_refused_at_upload_naming_the_line(
    named_api: httpx.Client, stream: object
) -> None:
    response = post_file(named_api, jsonl(chat_line("a", stream=False), chat_line("b", stream=stream)))
    error = api_error(response, 400)
    assert "line 2:" in error["message"] and "stream" in error["message"]
    assert "line 1:" not in error["message"]


# --- 503 while unhealthy ---------------------------------------------------------------------------
DOWN_UPSTREAM = ("--backend", "openai", "--upstream", "http://127.0.0.1:9/v1")  # nothing listens


def test_creating_a_batch_while_unhealthy_is_503_with_the_reason(api_factory: ApiFactory) -> None:
    client = api_factory(*DOWN_UPSTREAM)
    health = client.get("/health")
    assert health.status_code == 503
    file_id = upload(client, jsonl(chat_line("a")))["id"]
    response = post_batch(client, file_id)
    error = api_error(response, 503)
    assert int(response.headers["Retry-After"]) >= 1
    assert error["code"] == "service_unavailable"
    assert health.json()["reason"] in error["message"]
    assert client.get("/v1/batches").json()["data"] == []  # nothing was created


def test_the_client_retries_a_503_create_then_says_why(server_factory: ServerFactory, tmp_path: Path) -> None:
    server: LiveServer = server_factory(*DOWN_UPSTREAM, ready=(503,))  # up, and unhealthy
    waits: list[float] = []
    policy = RetryPolicy(max_retries=2, sleep=waits.append)
    with BatchGenHttpClient(server.base_url, retry=policy) as client:
        file_id = client.upload_file(write_jsonl(tmp_path / "in.jsonl", [chat_line("a")]))["id"]
        with pytest.raises(RetriesExhausted) as raised:
            client.create_batch(file_id)
    assert raised.value.status_code == 503 and raised.value.attempts == 3
    assert raised.value.code == "service_unavailable" and "upstream" in (raised.value.message or "")
    assert waits == [5.0, 5.0]  # Retry-After, as the server said


# --- OpenAI's create fields ----------------------------------------------------------------------------
def test_output_expires_after_sets_the_result_files_expiry(api_factory: ApiFactory) -> None:
    client = api_factory(*SMALL_CONTEXT, "--error-file", "openai")
    file_id = upload(client, jsonl(*_mixed({0}, 2)))["id"]
    batch = create_batch(client, file_id, output_expires_after={"anchor": "created_at", "seconds": 7200})
    batch = wait_for_status(client, batch["id"], {"completed"})
    for result_id in (batch["output_file_id"], batch["error_file_id"]):
        result = client.get(f"/v1/files/{result_id}").json()
        assert result["expires_at"] == result["created_at"] + 7200
    assert client.get(f"/v1/files/{file_id}").json()["expires_at"] is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"output_expires_after": {"anchor": "last_active_at", "seconds": 60}}, "output_expires_after"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": "soon"}}, "output_expires_after"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 0}}, "output_expires_after"),
        ({"output_expires_after": 3600}, "output_expires_after"),
        ({"priority": "high"}, "priority"),
        ({"completion_window": "24h\n"}, "completion_window"),
    ],
)
def test_bad_create_fields_are_a_400_naming_them(
    api: httpx.Client, extra: dict[str, object], param: str
) -> None:
    file_id = upload(api, jsonl(chat_line("a")))["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", **extra}
    error = api_error(api.post("/v1/batches", json=body), 400)
    assert error["param"] == param


# --- the openai SDK and the project's client, as a user of the guide --------------------------------
@pytest.fixture(scope="module")
def guide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from tests.live import start_server

    server = start_server(tmp_path_factory.mktemp("guide") / "storage", *SMALL_CONTEXT)
    yield server
    server.stop()


@pytest.mark.live
def test_the_openai_sdk_sees_every_request_and_can_set_output_expiry(
    guide_server: LiveServer, tmp_path: Path
) -> None:
    sdk = OpenAI(base_url=guide_server.api_url, api_key="unused")
    path = write_jsonl(tmp_path / "input.jsonl", _mixed({2}, 4))
    uploaded = sdk.files.create(file=path.open("rb"), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.error_file_id is None
    lines = [json.loads(line) for line in sdk.files.content(batch.output_file_id or "").text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["r0", "r1", "r2", "r3"]
    [failed] = [line for line in lines if line["error"]]
    assert failed["custom_id"] == "r2" and failed["response"] is None
    output = sdk.files.retrieve(batch.output_file_id or "")
    assert output.expires_at == output.created_at + 3600


@pytest.mark.live
def test_the_guides_one_liner_gets_every_requests_line(guide_server: LiveServer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "input.jsonl", _mixed({0, 5}, 8))
    with BatchGenHttpClient(guide_server.base_url) as client:
        batch = client.submit_batch(
            input_file_path=str(path), output_file_path=str(tmp_path / "output.jsonl"), max_decoding_length=8
        )
    assert batch["status"] == "completed"
    lines = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(8))
    assert sorted(line["custom_id"] for line in lines if line["error"]) == ["r0", "r5"]


@pytest.mark.live
def test_the_client_with_the_openai_switch_gets_the_error_file(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server: LiveServer = server_factory(*SMALL_CONTEXT, "--error-file", "openai")
    path = write_jsonl(tmp_path / "input.jsonl", _mixed({0, 5}, 8))
    with BatchGenHttpClient(server.base_url) as client:
        batch = client.submit_batch(
            input_file_path=str(path),
            output_file_path=str(tmp_path / "output.jsonl"),
            error_file_path=str(tmp_path / "errors.jsonl"),
        )
    output = [json.loads(line)["custom_id"] for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(line)["custom_id"] for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert batch["error_file_id"] is not None
    assert sorted(output) == sorted(f"r{i}" for i in range(8) if i not in (0, 5))
    assert sorted(errors) == ["r0", "r5"]
