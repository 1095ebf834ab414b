"""A batch file the server refuses is shown by the `batchgen` command with every problem listed,
one per line, several for a line that has several, and the count of any left out."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchgen.client import APIStatusError
from batchgen.client.cli import EXIT_SERVER_ERROR
from tests.live import LiveServer, chat_line, start_server, write_jsonl

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("cli-problems") / "storage")
    yield live
    live.stop()


def _submit(server: LiveServer, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgen.client.cli",
            "submit",
            str(path),
            "-o",
            str(path.with_suffix(".out")),
            "--base-url",
            server.base_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_problem_of_a_refused_file_is_on_its_own_line(server: LiveServer, tmp_path: Path) -> None:
    three = chat_line("a", "hi", max_tokens=0, temperature=9, top_p=3)
    lines = [three, *({**chat_line(f"r{i}", "hi"), "method": "GET"} for i in range(12))]
    result = _submit(server, write_jsonl(tmp_path / "in.jsonl", lines))
    assert result.returncode == EXIT_SERVER_ERROR
    shown = [line.strip() for line in result.stderr.splitlines()]
    first = [line for line in shown if line.startswith("line 1: ")]
    assert len(first) == 3
    assert "'body.max_tokens'" in first[0] and "'body.temperature'" in first[1] and "'body.top_p'" in first[2]
    assert [line for line in shown if line.startswith("line ")][-1].startswith("line 10: 'method'")
    assert shown[-1] == "and 3 more"
    assert "invalid batch input file:" in result.stderr


def test_the_problems_of_an_error_body() -> None:
    message = "Invalid batch input file: line 1: a; b; line 1: c; line 2: ... and 4 more problems on this line (and 7 more)"
    error = APIStatusError(
        "POST /v1/files returned HTTP 400",
        status_code=400,
        body={
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "file",
                "code": "invalid_batch_file",
            }
        },
    )
    assert error.line_problems == [
        "line 1: a; b",
        "line 1: c",
        "line 2: ... and 4 more problems on this line",
        "and 7 more",
    ]
    other = APIStatusError(
        "x", status_code=400, body={"error": {"message": message, "code": "invalid_request"}}
    )
    assert other.line_problems == []
