"""``batchgen-server --backend sglang`` end to end, with the fake ``sglang`` package on PYTHONPATH.

SGLang cannot be installed on these machines; ``tests/fakes/sglang`` stands in for it, written to
SGLang's documented offline-engine contract. The server process, its flags, HTTP API, storage
and output files are the real ones.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest

from batchgen.server.cli import settings_from_args
from tests.helpers import api_error, completion_line, jsonl, post_file
from tests.live import LiveServer, chat_line, wait_for_status, write_jsonl

FAKES = Path(__file__).resolve().parents[1] / "fakes"
SGLANG_FLAGS = ("--backend", "sglang", "--model-path", "fake-model")


@pytest.fixture
def fake_sglang_path(fake_sglang_env: pytest.MonkeyPatch) -> None:
    """Put the fake ``sglang`` on the PYTHONPATH that server processes inherit."""


def _submit(client: httpx.Client, path: Path) -> dict:
    with path.open("rb") as stream:
        uploaded = client.post("/v1/files", files={"file": stream}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    created = client.post(
        "/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions"}
    )
    assert created.status_code == 200, created.text
    return created.json()


def test_server_flags_build_the_engine_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FAKES))
    import sglang

    assert sglang.__version__.endswith("+fake")
    settings = settings_from_args(
        [
            *SGLANG_FLAGS,
            "--tp-size",
            "2",
            "--dp-size",
            "2",
            "--mem-fraction-static",
            "0.85",
            "--max-context-length",
            "1024",
            "--sglang-arg",
            "chunked-prefill-size=8192",
            "--sglang-arg",
            "enable_torch_compile=true",
        ]
    )
    backend = settings.build_backend()
    sglang.Engine.instances.clear()

    async def start_and_stop() -> None:
        await backend.start()
        await backend.stop()

    try:
        anyio.run(start_and_stop)
        [engine] = sglang.Engine.instances
    finally:
        sys.modules.pop("sglang", None)  # no other test should see an sglang imported
    assert engine.kwargs == {
        "model_path": "fake-model",
        "tp_size": 2,
        "dp_size": 2,
        "mem_fraction_static": 0.85,
        "context_length": 1024,
        "chunked_prefill_size": 8192,
        "enable_torch_compile": True,
    }
    assert engine.shutdown_called


def test_a_batch_runs_end_to_end_on_the_sglang_backend(
    fake_sglang_path: None, server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    server = server_factory(*SGLANG_FLAGS, "--sglang-arg", "chunked_prefill_size=4096")
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get("/health").json() == {"status": "healthy"}
        assert [model["id"] for model in client.get("/v1/models").json()["data"]] == ["fake-model"]
        lines = [chat_line(f"request-{i}", f"question {i}", max_tokens=8) for i in range(5)]
        batch = _submit(client, write_jsonl(tmp_path / "input.jsonl", lines))
        batch = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=20)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        assert batch["model"] == "fake-model"
        output = client.get(f"/v1/files/{batch['output_file_id']}/content")
        results = [json.loads(line) for line in output.text.splitlines()]
        assert sorted(line["custom_id"] for line in results) == [f"request-{i}" for i in range(5)]
        for line in results:
            body = line["response"]["body"]
            assert line["error"] is None and body["model"] == "fake-model"
            assert body["choices"][0]["finish_reason"] in {"stop", "length"}
            assert body["choices"][0]["message"]["content"]
            assert 1 <= body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 0
        assert batch["usage"]["output_tokens"] == sum(
            line["response"]["body"]["usage"]["completion_tokens"] for line in results
        )


def test_penalties_are_accepted_at_upload_and_reach_the_engine_by_name(
    fake_sglang_path: None,
    server_factory: Callable[..., LiveServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = tmp_path / "sampling.jsonl"
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    server = server_factory(*SGLANG_FLAGS)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        out_of_range = jsonl(
            chat_line("fine", frequency_penalty=1), chat_line("too-big", presence_penalty=2.5)
        )
        refused = api_error(post_file(client, out_of_range), 400)
        assert "line 2: 'body.presence_penalty'" in str(refused["message"])
        assert "between -2 and 2" in str(refused["message"])
        lines = [
            chat_line("chat", "question", max_tokens=4, frequency_penalty=0.5, presence_penalty=-2),
            chat_line("zero", "question", max_tokens=4, frequency_penalty=0),
        ]
        batch = _submit(client, write_jsonl(tmp_path / "input.jsonl", lines))
        batch = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=20)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
        uploaded = post_file(
            client, jsonl(completion_line("completion", "Once", max_tokens=4, presence_penalty=1.5))
        )
        assert uploaded.status_code == 200, uploaded.text
        created = client.post(
            "/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions"}
        )
        assert created.status_code == 200, created.text
        done = wait_for_status(client, created.json()["id"], {"completed", "failed"}, timeout_s=20)
        assert done["status"] == "completed", done
    sent = [json.loads(line)["sampling_params"] for line in record.read_text().splitlines()]
    penalties = sorted(
        ({name: value for name, value in params.items() if name.endswith("_penalty")} for params in sent),
        key=len,
    )
    assert penalties == [
        {},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.5, "presence_penalty": -2.0},
    ]


def test_engine_death_makes_health_503_and_fails_the_batch(
    fake_sglang_path: None,
    server_factory: Callable[..., LiveServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_SGLANG_DELAY_S", "0.01")
    monkeypatch.setenv("FAKE_SGLANG_DIE_AFTER", "1")
    server = server_factory(*SGLANG_FLAGS)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        lines = [chat_line(f"request-{i}", f"question {i}") for i in range(3)]
        batch = _submit(client, write_jsonl(tmp_path / "input.jsonl", lines))
        batch = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=20)
        assert batch["status"] == "failed", batch
        [error] = batch["errors"]["data"]
        assert error["code"] == "batch_failed"
        assert "the SGLang engine died: FakeEngineDied" in error["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "Retry-After" in health.headers
        body = health.json()
        assert body["status"] == "unhealthy"
        assert body["reason"].startswith("the SGLang engine died: FakeEngineDied")
