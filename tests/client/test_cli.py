"""The `batchgen` command end to end: run as a subprocess against live servers.

One shared server runs each request for 0.2 s on 10 slots, so a 100-request batch takes about
2 s (long enough to `tail` it while it runs) and prompts over 50 tokens get an error line.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from batchgen.client import BatchGenHttpClient
from batchgen.client._options import BatchOptions
from batchgen.client.cli import (
    EXIT_BATCH_FAILED,
    EXIT_CANNOT_CONNECT,
    EXIT_OK,
    EXIT_SERVER_ERROR,
    EXIT_USAGE,
    _batch_options,
    build_parser,
)
from tests.helpers import read_terminal
from tests.live import LiveServer, chat_line, free_port, start_server, write_jsonl

LONG_PROMPT = "word " * 200  # over --max-context-length 50: an error line


FLAGS = ("--simulated-latency-s", "0.2", "--max-pool-size", "10", "--max-context-length", "50")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The user guide's conventions: every request's line in the output file."""
    live = start_server(tmp_path_factory.mktemp("cli") / "storage", *FLAGS)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def openai_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """OpenAI's conventions: failed lines in a separate error file, ``expired`` past the window."""
    live = start_server(tmp_path_factory.mktemp("cli-openai") / "storage", *FLAGS, "--error-file", "openai")
    yield live
    live.stop()


@pytest.fixture
def client(server: LiveServer) -> Iterator[BatchGenHttpClient]:
    with BatchGenHttpClient(server.base_url) as client:
        yield client


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchgen.client.cli", *args]


def run_env(env: dict[str, str] | None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "BATCHGEN_BASE_URL"}
    return {**base, **(env or {})}


def batchgen(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(*args), capture_output=True, text=True, env=run_env(env), timeout=60)


def requests_file(path: Path, n: int, *, long: frozenset[int] = frozenset()) -> Path:
    lines = [chat_line(f"request-{i}", LONG_PROMPT if i in long else "What is 2+2?") for i in range(n)]
    return write_jsonl(path, lines)


def start_batch(client: BatchGenHttpClient, path: Path) -> dict:
    return client.create_batch(client.upload_file(path)["id"], max_decoding_length=8)


# --- submit --------------------------------------------------------------------------------------


def test_submit_waits_downloads_and_prints_the_batch(server: LiveServer, tmp_path: Path) -> None:
    path = requests_file(tmp_path / "input.jsonl", 20, long=frozenset({3}))
    out, err = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    result = batchgen(
        "submit", str(path), "-o", str(out), "--error-output", str(err),
        "--max-decoding-length", "8", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5",
        "--metadata", "team=a", "--metadata", "run=1=x", "--poll-interval", "0.1",
        "--base-url", server.base_url,
    )  # fmt: skip
    assert result.returncode == EXIT_OK, result.stderr
    batch = json.loads(result.stdout)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 20, "completed": 19, "failed": 1}
    sampling = {key: batch[key] for key in ("max_decoding_length", "temperature", "top_p", "top_k")}
    assert sampling == {"max_decoding_length": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5}
    assert batch["metadata"] == {"team": "a", "run": "1=x"}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["custom_id"] for row in rows) == sorted(f"request-{i}" for i in range(20))
    assert [row["custom_id"] for row in rows if row["error"]] == ["request-3"]
    assert batch["error_file_id"] is None and not err.exists()
    assert f"batch {batch['id']} created" in result.stderr
    assert "done," not in result.stderr  # stderr is not a terminal: no progress line


def test_submit_with_openai_conventions_writes_failed_lines_to_the_error_output(
    openai_server: LiveServer, tmp_path: Path
) -> None:
    path = requests_file(tmp_path / "input.jsonl", 20, long=frozenset({3}))
    out, err = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    result = batchgen(
        "submit", str(path), "-o", str(out), "--error-output", str(err), "--max-decoding-length", "8",
        "--poll-interval", "0.1", "--base-url", openai_server.base_url,
    )  # fmt: skip
    assert result.returncode == EXIT_OK, result.stderr
    batch = json.loads(result.stdout)
    assert batch["request_counts"] == {"total": 20, "completed": 19, "failed": 1}
    assert len(out.read_text().splitlines()) == 19
    assert [json.loads(line)["custom_id"] for line in err.read_text().splitlines()] == ["request-3"]


def test_submit_draws_a_progress_line_on_a_terminal(server: LiveServer, tmp_path: Path) -> None:
    path = requests_file(tmp_path / "input.jsonl", 30)
    controller, terminal = pty.openpty()  # stderr is a terminal; stdout a pipe
    args = ("submit", str(path), "-o", str(tmp_path / "out.jsonl"), "--poll-interval", "0.1")
    process = subprocess.Popen(
        command(*args, "--base-url", server.base_url), stdout=subprocess.PIPE, stderr=terminal
    )
    os.close(terminal)
    shown = read_terminal(controller)
    stdout, _ = process.communicate(timeout=30)
    assert process.returncode == EXIT_OK
    assert json.loads(stdout)["status"] == "completed"
    redrawn = [part for part in shown.decode().split("\r") if part.startswith("batch_")]
    assert len(redrawn) >= 2 and all(part.endswith("\x1b[K") for part in redrawn)
    assert "30/30 done, 0 failed" in redrawn[-1]


def test_submit_of_a_batch_that_fails_exits_1(server_factory, tmp_path: Path) -> None:
    small = server_factory("--max-intake-capacity", "5")
    path = requests_file(tmp_path / "input.jsonl", 10)
    out = str(tmp_path / "out.jsonl")
    result = batchgen("submit", str(path), "-o", out, "--poll-interval", "0.1", "--base-url", small.base_url)
    assert result.returncode == EXIT_BATCH_FAILED, result.stderr
    assert json.loads(result.stdout)["status"] == "failed"
    assert "ended failed: capacity_exceeded" in result.stderr
    assert result.stderr.count("capacity_exceeded") == 1  # errors.data and error: said once


@pytest.mark.parametrize(("conventions", "status"), [("server", "failed"), ("openai_server", "expired")])
def test_submit_of_a_batch_that_runs_out_of_time_exits_1(
    request: pytest.FixtureRequest, tmp_path: Path, conventions: str, status: str
) -> None:
    live: LiveServer = request.getfixturevalue(conventions)
    path = requests_file(tmp_path / "input.jsonl", 200)  # about 4 s of work, given 1 s
    out = str(tmp_path / "out.jsonl")
    args = ("--completion-window", "1s", "--base-url", live.base_url)  # polls after 1, 2.5, 4.75 s
    result = batchgen("submit", str(path), "-o", out, *args)
    assert result.returncode == EXIT_BATCH_FAILED, result.stderr
    batch = json.loads(result.stdout)
    assert (batch["status"], batch["completion_window"]) == (status, "1s")
    assert batch["request_counts"]["completed"] < 200
    assert f"batch {batch['id']} ended {status}" in result.stderr
    if status == "failed":
        assert "timed out" in result.stderr and batch["error"]["code"] == "batch_failed"


# --- status, list, pool, download, cancel ----------------------------------------------------------


def test_status_list_pool_and_download(
    server: LiveServer, client: BatchGenHttpClient, tmp_path: Path
) -> None:
    batch = start_batch(client, requests_file(tmp_path / "input.jsonl", 5))
    batch = client.wait_for_batch(batch["id"], poll_interval=0.1)
    url = ("--base-url", server.base_url)

    status = batchgen("status", batch["id"], *url)
    assert status.returncode == EXIT_OK and json.loads(status.stdout)["id"] == batch["id"]
    listing = batchgen("list", "--limit", "100", *url)
    assert listing.returncode == EXIT_OK
    assert batch["id"] in [b["id"] for b in json.loads(listing.stdout)["data"]]
    pool = batchgen("pool", *url)
    assert pool.returncode == EXIT_OK and json.loads(pool.stdout)["scheduling_pool_capacity"] == 10

    expected = client.download_file_content(batch["output_file_id"])
    for identifier in (batch["id"], batch["output_file_id"]):
        target = tmp_path / f"{identifier}.jsonl"
        download = batchgen("download", identifier, "-o", str(target), *url)
        assert download.returncode == EXIT_OK, download.stderr
        assert target.read_bytes() == expected
    no_errors = batchgen("download", batch["id"], "--errors", "-o", str(tmp_path / "e.jsonl"), *url)
    assert no_errors.returncode == EXIT_BATCH_FAILED
    assert "has no error file" in no_errors.stderr
    assert not (tmp_path / "e.jsonl").exists()


def test_cancel_then_tail_exits_1(server: LiveServer, client: BatchGenHttpClient, tmp_path: Path) -> None:
    batch = start_batch(client, requests_file(tmp_path / "input.jsonl", 200))  # about 4 s of work
    cancel = batchgen("cancel", batch["id"], "--base-url", server.base_url)
    assert cancel.returncode == EXIT_OK, cancel.stderr
    assert json.loads(cancel.stdout)["status"] in {"cancelling", "cancelled"}
    tail = batchgen("tail", batch["id"], "--poll-interval", "0.1", "--base-url", server.base_url)
    assert tail.returncode == EXIT_BATCH_FAILED
    assert f"batch {batch['id']} ended cancelled" in tail.stderr
    again = batchgen("cancel", batch["id"], "--base-url", server.base_url)
    assert again.returncode == EXIT_OK, again.stderr  # cancelling a cancelled batch returns it
    assert json.loads(again.stdout)["status"] == "cancelled"


# --- tail ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("conventions", "output_lines"), [("server", 100), ("openai_server", 97)])
def test_tail_prints_every_line_of_a_running_batch(
    request: pytest.FixtureRequest, tmp_path: Path, conventions: str, output_lines: int
) -> None:
    server: LiveServer = request.getfixturevalue(conventions)
    client = BatchGenHttpClient(server.base_url)
    long = frozenset({7, 50, 93})
    batch = start_batch(client, requests_file(tmp_path / "input.jsonl", 100, long=long))
    args = ("tail", batch["id"], "--errors", "--poll-interval", "0.2", "--base-url", server.base_url)
    process = subprocess.Popen(command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    lines: list[str] = []
    status_at_first_line = None
    for line in process.stdout:
        if not lines:
            status_at_first_line = client.get_batch(batch["id"])["status"]
        lines.append(line)
    _, stderr = process.communicate(timeout=30)  # little on stderr: its pipe cannot fill up
    assert process.returncode == EXIT_OK, stderr
    assert status_at_first_line == "in_progress"  # it printed results while the batch ran
    rows = [json.loads(line) for line in lines]
    assert sorted(row["custom_id"] for row in rows) == sorted(f"request-{i}" for i in range(100))
    assert sorted(row["custom_id"] for row in rows if row["error"]) == sorted(f"request-{i}" for i in long)

    outputs_only = batchgen("tail", batch["id"], "--base-url", server.base_url)  # ended: prints, exits
    assert outputs_only.returncode == EXIT_OK
    assert len(outputs_only.stdout.splitlines()) == output_lines
    client.close()


def test_submit_polls_adaptively_unless_told_an_interval() -> None:
    parser = build_parser()
    assert parser.parse_args(["submit", "in.jsonl", "-o", "out.jsonl"]).poll_interval is None
    given = parser.parse_args(["submit", "in.jsonl", "-o", "out.jsonl", "--poll-interval", "2"])
    assert given.poll_interval == 2.0
    help_text = " ".join(batchgen("submit", "--help").stdout.split())
    assert "seconds between polls (default: 1 s, then 1.5 times the wait before, up to 5 s)" in help_text


def test_submit_has_a_flag_for_every_batch_option() -> None:
    flags = {
        "--completion-window": ("2h", "2h"),
        "--metadata": ("team=a", {"team": "a"}),
        "--max-decoding-length": ("8", 8),
        "--temperature": ("0.5", 0.5),
        "--top-p": ("0.9", 0.9),
        "--top-k": ("5", 5),
        "--output-order": ("input", "input"),
    }
    assert sorted(flags) == sorted("--" + option.name.replace("_", "-") for option in fields(BatchOptions))
    given = [word for flag, (text, _) in flags.items() for word in (flag, text)]
    args = build_parser().parse_args(["submit", "in.jsonl", "-o", "out.jsonl", *given])
    assert _batch_options(args) == {flag[2:].replace("-", "_"): value for flag, (_, value) in flags.items()}
    defaults = build_parser().parse_args(["submit", "in.jsonl", "-o", "out.jsonl"])
    assert _batch_options(defaults) == {option.name: option.default for option in fields(BatchOptions)}


# --- errors and exit codes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["submit", "input.jsonl"],  # no -o
        ["submit", "input.jsonl", "-o", "out.jsonl", "--metadata", "no-equals-sign"],
        ["submit", "input.jsonl", "-o", "out.jsonl", "--poll-interval", "-1"],
        ["submit", "input.jsonl", "-o", "out.jsonl", "--max-decoding-length", "0"],
        ["submit", "missing.jsonl", "-o", "out.jsonl"],
        ["submit", "input.jsonl", "-o", "no/such/folder/out.jsonl"],
        ["download", "file-abc", "-o", "out.jsonl", "--errors"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str]) -> None:
    requests_file(tmp_path / "input.jsonl", 1)
    port = free_port()  # nothing listens: a usage error must be found before any request
    result = subprocess.run(
        command(*args, "--base-url", f"http://127.0.0.1:{port}", "--retries", "0") if args else command(),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=run_env(None),
        timeout=30,
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "error" in result.stderr
    assert result.stdout == ""


def test_server_error_exits_3_with_the_servers_message(server: LiveServer) -> None:
    result = batchgen("status", "batch_nope", "--base-url", server.base_url)
    assert result.returncode == EXIT_SERVER_ERROR
    assert "HTTP 404: No batch with id 'batch_nope'." in result.stderr
    assert result.stdout == ""


def test_cannot_connect_exits_4_after_retrying() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = batchgen("pool", "--base-url", url, "--retries", "1")
    assert result.returncode == EXIT_CANNOT_CONNECT
    assert time.monotonic() - started >= 1.0  # one retry, after 1 to 1.5 s
    assert "retry 1 of 1" in result.stderr
    assert f"cannot reach the server at {url}" in result.stderr


def test_base_url_from_the_environment_and_the_flag_in_either_place(server: LiveServer) -> None:
    from_env = batchgen("pool", env={"BATCHGEN_BASE_URL": server.base_url})
    assert from_env.returncode == EXIT_OK, from_env.stderr
    dead = {"BATCHGEN_BASE_URL": f"http://127.0.0.1:{free_port()}"}
    before = batchgen("--base-url", server.base_url, "pool", env=dead)
    after = batchgen("pool", "--base-url", server.base_url, env=dead)
    assert (before.returncode, after.returncode) == (EXIT_OK, EXIT_OK)


def test_console_script_and_python_dash_m() -> None:
    script = Path(sys.executable).with_name("batchgen")
    if not script.exists():
        pytest.skip("batchgen-client is not installed in this environment")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == EXIT_OK and "tail" in result.stdout
    module = subprocess.run(
        [sys.executable, "-m", "batchgen.client", "--help"], capture_output=True, text=True, timeout=30
    )
    assert module.returncode == EXIT_OK and module.stdout == result.stdout
