"""The official ``openai`` SDK against a live server: files and batches end to end."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import chat_line, completion_line, write_jsonl
from tests.live import LiveServer


@pytest.fixture
def client(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live_server.api_url, api_key="unused", max_retries=0) as sdk:
        yield sdk


def _upload(client: openai.OpenAI, path: Path) -> str:
    with path.open("rb") as stream:
        return client.files.create(file=stream, purpose="batch").id


def test_files_create_list_retrieve_content_delete(client: openai.OpenAI, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "input.jsonl", [chat_line(f"req-{i}") for i in range(3)])
    with path.open("rb") as stream:
        created = client.files.create(file=stream, purpose="batch")
    assert created.filename == "input.jsonl"
    assert created.bytes == path.stat().st_size
    assert created.purpose == "batch"

    assert client.files.retrieve(created.id).id == created.id
    listed = [file.id for file in client.files.list(purpose="batch")]
    assert created.id in listed
    assert client.files.content(created.id).content == path.read_bytes()

    deleted = client.files.delete(created.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_batch_runs_to_completion_with_output_lines(
    client: openai.OpenAI, live_server: LiveServer, tmp_path: Path
) -> None:
    lines = [chat_line(f"req-{i}", f"question number {i}") for i in range(25)]
    file_id = _upload(client, write_jsonl(tmp_path / "input.jsonl", lines))
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "sdk-test"},
    )
    assert batch.status in {"validating", "in_progress", "completed"}
    assert batch.metadata == {"job": "sdk-test"}

    for _ in range(600):
        batch = client.batches.retrieve(batch.id)
        if batch.status == "completed":
            break
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (25, 25)
    assert batch.completed_at is not None and batch.in_progress_at is not None

    assert batch.output_file_id is not None
    content = client.files.content(batch.output_file_id).content
    output = [json.loads(line) for line in content.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(25))
    body = output[0]["response"]["body"]
    assert output[0]["response"]["status_code"] == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    # The output file is the incremental file on disk, not a copy.
    incremental = live_server.storage_path / "incremental" / f"{batch.id}.jsonl"
    assert incremental.read_bytes() == content


def test_batches_list_pages_newest_first(client: openai.OpenAI, tmp_path: Path) -> None:
    created = []
    for n in range(5):
        file_id = _upload(client, write_jsonl(tmp_path / f"in-{n}.jsonl", [chat_line("only")]))
        created.append(
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id
        )
    first_page = client.batches.list(limit=2)
    assert [batch.id for batch in first_page.data] == created[::-1][:2]
    assert first_page.has_more is True
    seen = [batch.id for batch in client.batches.list(limit=2)]  # auto-pagination
    assert seen[:5] == created[::-1]
    assert len(seen) == len(set(seen))


def test_cancel_running_batch(server_factory: Callable[..., LiveServer], tmp_path: Path) -> None:
    slow = server_factory("--simulated-latency-s", "0.2", "--max-pool-size", "2")
    with openai.OpenAI(base_url=slow.api_url, api_key="unused", max_retries=0) as sdk:
        file_id = _upload(sdk, write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}") for i in range(200)]))
        batch = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while sdk.batches.retrieve(batch.id).request_counts.completed < 2:  # type: ignore[union-attr]
            pass
        cancelled = sdk.batches.cancel(batch.id)
        assert cancelled.status in {"cancelling", "cancelled"}
        again = sdk.batches.cancel(batch.id)  # a cancel retried (after a timeout, say) is no error
        assert again.id == batch.id and again.status in {"cancelling", "cancelled"}
        for _ in range(200):
            cancelled = sdk.batches.retrieve(batch.id)
            if cancelled.status == "cancelled":
                break
        assert cancelled.status == "cancelled"
        assert cancelled.cancelled_at is not None
        assert sdk.batches.cancel(batch.id).model_dump() == cancelled.model_dump()  # as it is
        counts = cancelled.request_counts
        assert counts is not None and 2 <= counts.completed < 200
        # Results already written stay downloadable, and nothing more is written after cancel.
        assert cancelled.output_file_id is not None
        written = sdk.files.content(cancelled.output_file_id).content.splitlines()
        assert len(written) == counts.completed
        assert sdk.batches.retrieve(batch.id).request_counts.completed == counts.completed  # type: ignore[union-attr]
        pool = httpx.get(f"{slow.base_url}/v1/pool/status").json()
        assert pool["intake_pool_size"] == 0 and pool["active_batches"] == 0


def test_completions_endpoint(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [
        completion_line(f"c{i}", f"Once upon a time {i}", model="default", max_tokens=5) for i in range(4)
    ]
    file_id = _upload(client, write_jsonl(tmp_path / "in.jsonl", lines))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    while batch.status not in {"completed", "failed"}:
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert batch.output_file_id is not None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).content.splitlines()]
    for line in output:
        body = line["response"]["body"]
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] <= 5
        assert body["choices"][0]["finish_reason"] in {"stop", "length"}


def test_batch_level_parameters_through_extra_body(client: openai.OpenAI, tmp_path: Path) -> None:
    file_id = _upload(
        client, write_jsonl(tmp_path / "in.jsonl", [chat_line("a"), chat_line("b", max_tokens=2)])
    )
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"max_decoding_length": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 20},
    )
    extra = batch.model_extra or {}
    assert (extra["max_decoding_length"], extra["temperature"], extra["top_p"], extra["top_k"]) == (
        3,
        0.5,
        0.9,
        20,
    )
    while batch.status != "completed":
        batch = client.batches.retrieve(batch.id)
    assert batch.output_file_id is not None
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).content.splitlines()]
    tokens = {line["custom_id"]: line["response"]["body"]["usage"]["completion_tokens"] for line in lines}
    assert tokens == {"a": 3, "b": 2}  # simulated answers are 4+ tokens long, so both limits bind
