"""The result cache in front of the real SmolLM2-135M-Instruct model (``model``, ``live``): a
second run of the same greedy requests is answered from the cache, with the first run's response
bodies byte for byte (but for ``cached_tokens``, then every prompt token), and the model computes
nothing for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests import packaged_model
from tests.helpers import as_replayed, chat_line, completion_line, jsonl, upload, wait_for_status
from tests.live import start_server

pytestmark = [pytest.mark.model, pytest.mark.live]


class _Response(msgspec.Struct):
    body: msgspec.Raw


class _Line(msgspec.Struct):
    custom_id: str
    response: _Response | None
    cached: bool = False


def _run(client: httpx.Client, content: bytes, endpoint: str) -> tuple[dict[str, Any], dict[str, _Line]]:
    file_id = upload(client, content)["id"]
    created = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint}).json()
    batch = wait_for_status(client, created["id"], {"completed", "failed"}, timeout_s=300)
    assert batch["status"] == "completed", batch
    output = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    lines = [msgspec.json.decode(raw, type=_Line) for raw in output.splitlines()]
    return batch, {line.custom_id: line for line in lines}


def _prompt_tokens(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("batchgen_prompt_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no batchgen_prompt_tokens_total")


def test_a_second_greedy_run_on_the_real_model_comes_from_the_cache_byte_for_byte(tmp_path: Path) -> None:
    storage = packaged_model.link_into(tmp_path / "storage")
    server = start_server(
        storage, "--backend", "transformers", "--result-cache-tenant", "default", timeout_s=600
    )
    try:
        chats = [
            chat_line(f"c{i}", question, temperature=0, max_tokens=12)
            for i, question in enumerate(["What is 2+2?", "Name a colour.", "Say hello in French."])
        ]
        completions = [
            completion_line(f"p{i}", f"The capital of country {i} is", max_tokens=8, temperature=0)
            for i in range(2)
        ]
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            first_chat, chat_lines = _run(client, jsonl(*chats), "/v1/chat/completions")
            first_completion, completion_lines = _run(client, jsonl(*completions), "/v1/completions")
            computed = _prompt_tokens(client)
            again_chat, chat_again = _run(client, jsonl(*chats), "/v1/chat/completions")
            again_completion, completion_again = _run(client, jsonl(*completions), "/v1/completions")
            assert _prompt_tokens(client) == computed, "the model computed something for the second run"
        for first, again in ((chat_lines, chat_again), (completion_lines, completion_again)):
            assert set(first) == set(again)
            for custom_id, line in again.items():
                assert line.cached and not first[custom_id].cached
                replayed, original = line.response, first[custom_id].response
                assert replayed is not None and original is not None
                assert bytes(replayed.body) == as_replayed(bytes(original.body))
        assert first_chat["usage"]["cached_requests"] == 0
        assert again_chat["usage"]["cached_requests"] == 3
        assert again_completion["usage"]["cached_requests"] == 2
        assert again_chat["usage"]["saved_tokens"] == first_chat["usage"]["total_tokens"]
        assert first_completion["usage"]["saved_tokens"] == 0
    finally:
        server.stop()
