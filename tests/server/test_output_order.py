"""``output_order``: result files in input order once a batch ends, through the real app.

Requests with different ``max_tokens`` under a per-token latency finish out of input order, and
lines longer than the simulated context fail, so the incremental file is in completion order with
error lines among its results; the batch's files must end in input order, holding those same
lines. The default stays the completion order, and a bad value is a 400 naming the field.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from batchgen.server.cli import build_parser, settings_from_args
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import (
    TERMINAL,
    ApiFactory,
    api_error,
    chat_line,
    file_lines,
    jsonl,
    post_batch,
    submit,
    upload,
    wait_for_status,
)

#: Each request takes 2 ms per output token, 8 at a time: a line's max_tokens sets when it ends; a
#: prompt over 200 tokens fails.
SPREAD = ("--simulated-token-latency-s", "0.002", "--max-pool-size", "8", "--max-context-length", "200")
_LONG_PROMPT = "word " * 300  # past --max-context-length 200: rejected, an error line


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, httpx.Client]]:
    """Two servers whose requests end out of order: failed lines in the output file, or (True)
    in a separate error file."""
    root = tmp_path_factory.mktemp("spread")
    with (
        TestClient(in_process_app(root / "output", *SPREAD), timeout=30) as output,
        TestClient(in_process_app(root / "openai", *SPREAD, "--error-file", "openai"), timeout=30) as openai,
    ):
        yield {False: output, True: openai}


def _lines(tokens: list[int], failing: set[int]) -> list[dict[str, Any]]:
    return [
        chat_line(f"req-{n}", _LONG_PROMPT if n in failing else f"line {n}", max_tokens=max_tokens)
        for n, max_tokens in enumerate(tokens)
    ]


def _ids(lines: list[dict[str, Any]]) -> list[str]:
    return [line["custom_id"] for line in lines]


@settings(max_examples=examples(6), deadline=None)
@given(
    tokens=st.lists(st.integers(1, 40), min_size=2, max_size=40),
    failing=st.sets(st.integers(0, 39), max_size=8),
    openai_errors=st.booleans(),
)
def test_an_ordered_batch_ends_with_its_files_in_input_order(
    spread: dict[bool, httpx.Client], tokens: list[int], failing: set[int], openai_errors: bool
) -> None:
    client = spread[openai_errors]
    lines = _lines(tokens, {n for n in failing if n < len(tokens)})
    batch = submit(client, lines, output_order="input")
    assert batch["output_order"] == "input"
    batch = wait_for_status(client, batch["id"], TERMINAL)
    assert batch["status"] == "completed", batch
    assert batch["output_order"] == "input"
    output = file_lines(client, batch["output_file_id"])
    errors = file_lines(client, batch["error_file_id"])
    expected = _ids(lines)
    for part in (output, errors):  # each file in input order
        ids = [line["custom_id"] for line in part]
        assert ids == [custom_id for custom_id in expected if custom_id in set(ids)]
    assert sorted(line["custom_id"] for line in output + errors) == sorted(expected)  # exactly once
    failed = {f"req-{n}" for n in failing if n < len(tokens)}
    assert {line["custom_id"] for line in output + errors if line["error"]} == failed
    assert batch["request_counts"] == {
        "total": len(lines),
        "completed": len(lines) - len(failed),
        "failed": len(failed),
    }


def test_the_default_order_is_completion_and_the_server_flag_changes_it(api_factory: ApiFactory) -> None:
    lines = _lines([30, 1, 20, 2, 10, 3], set())
    default = api_factory(*SPREAD, storage="default")
    batch = wait_for_status(default, submit(default, lines)["id"], TERMINAL)
    assert batch["output_order"] == "completion"
    appended = [line["custom_id"] for line in file_lines(default, batch["output_file_id"])]
    assert sorted(appended) == sorted(_ids(lines)) and appended != _ids(lines)  # as they finished

    ordered = api_factory(*SPREAD, "--output-order", "input", storage="ordered")
    batch = wait_for_status(ordered, submit(ordered, lines)["id"], TERMINAL)
    assert batch["output_order"] == "input"
    assert [line["custom_id"] for line in file_lines(ordered, batch["output_file_id"])] == _ids(lines)
    # a create call's own choice wins over the server's
    batch = wait_for_status(ordered, submit(ordered, lines, output_order="completion")["id"], TERMINAL)
    assert batch["output_order"] == "completion"


@pytest.mark.parametrize(
    "value", ["Input", "", "random", 1, True, ["input"], {"order": "input"}, "x" * 10_000]
)
def test_an_unknown_output_order_is_a_400_naming_it(api: httpx.Client, value: object) -> None:
    file_id = upload(api, jsonl(chat_line("a")))["id"]
    error = api_error(post_batch(api, file_id, output_order=value), 400)
    assert error["param"] == "output_order"
    assert "output_order" in error["message"] and len(error["message"]) < 200


def test_the_incremental_file_serves_while_an_ordered_batch_runs(api_factory: ApiFactory) -> None:
    client = api_factory("--simulated-latency-s", "0.05", "--max-pool-size", "1", storage="running")
    lines = [chat_line(f"r{n}") for n in range(40)]
    batch = submit(client, lines, output_order="input")
    seen = wait_for_status(client, batch["id"], {"in_progress"})
    while seen["request_counts"]["completed"] < 2:
        seen = client.get(f"/v1/batches/{batch['id']}").json()
    partial = client.get(f"/v1/files/{seen['output_file_id']}/content")
    assert partial.status_code == 200
    got = [json.loads(line)["custom_id"] for line in partial.content.splitlines()]
    assert got and set(got) <= set(_ids(lines))
    client.post(f"/v1/batches/{batch['id']}/cancel")
    batch = wait_for_status(client, batch["id"], TERMINAL)
    assert batch["status"] == "cancelled"
    ids = [line["custom_id"] for line in file_lines(client, batch["output_file_id"])]
    assert ids == [custom_id for custom_id in _ids(lines) if custom_id in set(ids)]  # cancelled: ordered too
    assert len(ids) == batch["request_counts"]["completed"] and len(ids) >= len(got)


def test_a_restart_finishes_the_rewrite_of_a_batch_left_cancelling(tmp_path: Path) -> None:
    """A server stopped while an ordered batch's cancel was being put in order leaves it
    ``cancelling`` with its file in completion order (as made here by hand); the next start puts
    the file in order before the batch ends ``cancelled``."""
    lines = _lines([30, 1, 20, 2, 10, 3, 25, 4], set())
    storage = tmp_path / "left"
    with TestClient(in_process_app(storage, *SPREAD), timeout=30) as first:
        batch = wait_for_status(first, submit(first, lines)["id"], TERMINAL)
        appended = [line["custom_id"] for line in file_lines(first, batch["output_file_id"])]
    assert appended != _ids(lines)
    with sqlite3.connect(storage / "metadata.sqlite3") as database:
        database.execute(
            "UPDATE batches SET status = 'cancelling', output_order = 'input', completed_at = NULL, "
            "finalizing_at = NULL, cancelling_at = created_at WHERE id = ?",
            [batch["id"]],
        )
    database.close()
    with TestClient(in_process_app(storage, *SPREAD), timeout=30) as second:
        batch = wait_for_status(second, batch["id"], TERMINAL)
        assert batch["status"] == "cancelled" and batch["output_order"] == "input"
        assert [line["custom_id"] for line in file_lines(second, batch["output_file_id"])] == _ids(lines)
        assert batch["request_counts"]["completed"] == len(lines)


def test_the_server_flag_is_in_help_and_refuses_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    help_text = build_parser().format_help()
    assert "--output-order {completion,input}" in help_text
    assert settings_from_args(["--output-order", "input"]).service_settings().output_order == "input"
    assert settings_from_args([]).service_settings().output_order == "completion"
    with pytest.raises(SystemExit) as refused:
        settings_from_args(["--output-order", "sorted"])
    assert refused.value.code == 2 and "--output-order" in capsys.readouterr().err
