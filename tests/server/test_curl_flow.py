"""The user guide's curl walkthrough, step by step, with the real ``curl`` command."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests.helpers import chat_line, write_jsonl
from tests.live import LiveServer


def curl(*args: str) -> str:
    result = subprocess.run(
        ["curl", "-sS", "--fail-with-body", *args], capture_output=True, text=True, check=True
    )
    return result.stdout


def test_guide_curl_flow(live_server: LiveServer, tmp_path: Path) -> None:
    base = live_server.base_url
    write_jsonl(tmp_path / "input.jsonl", [chat_line(f"request-{i}") for i in range(1, 6)])

    # Upload
    uploaded = json.loads(
        curl(
            "-X", "POST", f"{base}/v1/files", "-F", f"file=@{tmp_path / 'input.jsonl'}", "-F", "purpose=batch"
        )
    )
    assert uploaded["object"] == "file" and uploaded["id"].startswith("file-")

    # Create batch
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "max_decoding_length": 4096}
    created = json.loads(
        curl(
            "-X", "POST", f"{base}/v1/batches", "-H", "Content-Type: application/json", "-d", json.dumps(body)
        )
    )
    assert created["object"] == "batch" and created["max_decoding_length"] == 4096

    # Check status
    deadline = time.monotonic() + 30
    while True:
        batch = json.loads(curl(f"{base}/v1/batches/{created['id']}"))
        if batch["status"] == "completed" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}

    # Download output
    output = tmp_path / "output.jsonl"
    curl(f"{base}/v1/files/{batch['output_file_id']}/content", "-o", str(output))
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert {line["custom_id"] for line in lines} == {f"request-{i}" for i in range(1, 6)}
    assert all(line["error"] is None and line["id"].startswith("batch_req_") for line in lines)

    # Monitoring
    pool = json.loads(curl(f"{base}/v1/pool/status"))
    assert set(pool) == {
        "intake_pool_size",
        "intake_pool_capacity",
        "scheduling_pool_active",
        "scheduling_pool_free",
        "scheduling_pool_capacity",
        "active_batches",
        "pool_mode",
        "requests_completed_total",
        "requests_failed_total",
        "prompt_tokens_total",
        "completion_tokens_total",
        "engine_running",
        "engine_waiting",
        "engines",
        "generated_tokens_total",
        "generated_tokens_counted",
        "requests_per_second",
        "tokens_per_second",
        "rate_time_constant_s",
    }
    assert pool["requests_completed_total"] == 5
    assert json.loads(curl(f"{base}/health")) == {"status": "healthy"}
    models = json.loads(curl(f"{base}/v1/models"))
    assert models["object"] == "list" and models["data"][0]["id"] == "simulated"
