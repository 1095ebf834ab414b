"""A backend from a separate package: examples/batchgen-backend-echo, installed by pip, served.

The package is installed into a folder of its own (``echo_site`` in tests/conftest.py) that the
server process gets on its PYTHONPATH, so ``batchgen-server`` finds it only through its
``batchgen.backends`` entry point, as it would find any installed package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.live import LiveServer, chat_line, wait_for_status, write_jsonl


@pytest.fixture
def echo_on_pythonpath(echo_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(echo_site), os.environ.get("PYTHONPATH")]))
    )


def test_help_lists_the_installed_backend_and_its_flags(echo_on_pythonpath: None) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "batchgen.server.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "echo backend:" in shown.stdout
    assert "--echo-prefix ECHO_PREFIX" in shown.stdout
    assert "--echo-token-delay-s ECHO_TOKEN_DELAY_S" in shown.stdout
    assert "'echo' answers each request with its own words" in " ".join(shown.stdout.split())


def test_a_batch_is_served_by_the_installed_backend(
    echo_on_pythonpath: None, server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    server = server_factory("--backend", "echo", "--echo-prefix", "Echo:", "--max-context-length", "20")
    lines = [
        chat_line("plain", "What is two plus two"),
        chat_line("cut", "one two three four five six", max_tokens=3),
        chat_line("stopped", "red green blue yellow", stop=["blue"]),
        chat_line("parts", [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]),
        chat_line("long", " ".join(["word"] * 30)),
    ]
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        assert [model["id"] for model in client.get("/v1/models").json()["data"]] == ["echo"]
        with write_jsonl(tmp_path / "input.jsonl", lines).open("rb") as stream:
            uploaded = client.post("/v1/files", files={"file": stream}, data={"purpose": "batch"}).json()
        batch = client.post(
            "/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions"}
        ).json()
        batch = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=30)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
        assert batch["error_file_id"] is None  # the failed request's line is in the output file
        output = [
            json.loads(line)
            for line in client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
        ]
    bodies = {line["custom_id"]: line["response"]["body"] for line in output if line["error"] is None}
    answers = {
        custom_id: (
            body["choices"][0]["message"]["content"],
            body["choices"][0]["finish_reason"],
            body["usage"]["prompt_tokens"],
            body["usage"]["completion_tokens"],
        )
        for custom_id, body in bodies.items()
    }
    assert answers == {
        "plain": ("Echo: What is two plus two", "stop", 5, 6),
        "cut": ("Echo: one two", "length", 6, 3),
        "stopped": ("Echo: red green ", "stop", 4, 3),
        "parts": ("Echo: first part second", "stop", 3, 4),
    }
    assert {body["model"] for body in bodies.values()} == {"echo"}
    [error] = [line for line in output if line["error"] is not None]
    assert error["custom_id"] == "long"
    assert error["error"] == {
        "code": "context_length_exceeded",
        "message": "Prompt length 30 exceeds model context 20",
    }
