"""The grammar bounds through a real server: the ``--grammar-*`` flags, error lines, and cancel.

A ``batchgen-server --backend transformers`` process with the tiny random-weight model
(``tiny_model``): schemas past a bound, too slow to compile or impossible are their lines' error
lines (``invalid_request``, never retried) while the batch's other lines complete, and cancelling a
batch whose line waits for its grammar ends it promptly while ``/health`` stays healthy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import chat_line, file_lines, submit, wait_for_status
from tests.live import start_server

pytestmark = [pytest.mark.model, pytest.mark.live]


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def _slow_schema(properties: int) -> dict[str, Any]:
    """Optional properties make the grammar's compile grow steeply: seconds to minutes."""
    return {"type": "object", "properties": {f"p{index}": {"type": "string"} for index in range(properties)}}


def test_schemas_past_the_flags_bounds_are_their_lines_errors(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(
        tmp_path / "storage",
        "--backend",
        "transformers",
        "--model",
        str(tiny_model),
        "--grammar-compile-timeout",
        "0.5",
        "--grammar-max-enum-values",
        "20",
        "--grammar-max-properties",
        "5000",
        timeout_s=300,
    )
    try:
        lines = [
            chat_line(
                "big", max_tokens=10, response_format=_schema_format({"enum": [f"v{i}" for i in range(30)]})
            ),
            chat_line("slow", max_tokens=10, response_format=_schema_format(_slow_schema(2000))),
            chat_line(
                "impossible",
                max_tokens=10,
                response_format=_schema_format({"allOf": [{"type": "string"}, {"type": "integer"}]}),
            ),
            *(chat_line(f"plain-{index}", max_tokens=5) for index in range(3)),
        ]
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            batch = wait_for_status(
                client, submit(client, lines)["id"], {"completed", "failed"}, timeout_s=300
            )
            assert batch["status"] == "completed", batch
            assert batch["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
            output = file_lines(client, batch["output_file_id"]) + file_lines(client, batch["error_file_id"])
        results = {line["custom_id"]: line for line in output}
        expected = {
            "big": "is too large: 30 enum values, more than 20 (--grammar-max-enum-values)",
            "slow": "took longer than 0.5 s to compile",
            "impossible": "can never be satisfied",
        }
        for custom_id, words in expected.items():
            error = results[custom_id]["error"]
            assert results[custom_id]["response"] is None
            assert error["code"] == "invalid_request" and words in error["message"], error
            assert "'body.response_format.json_schema'" in error["message"]
        for index in range(3):
            body = results[f"plain-{index}"]["response"]["body"]
            assert body["usage"]["completion_tokens"] == 5
    finally:
        server.stop()


def test_cancel_reaches_a_line_waiting_for_its_grammar(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(
        tmp_path / "storage",
        "--backend",
        "transformers",
        "--model",
        str(tiny_model),
        "--grammar-compile-timeout",
        "600",
        "--grammar-max-properties",
        "10000",
        "--grammar-max-schema-bytes",
        "1000000",
        timeout_s=300,
    )
    try:
        lines = [
            chat_line("slow", max_tokens=10, response_format=_schema_format(_slow_schema(3000))),
            chat_line("plain", max_tokens=3),
        ]
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            batch = submit(client, lines)
            # The plain line finishing shows the loop decodes while the slow line waits.
            for _ in range(6000):
                batch = client.get(f"/v1/batches/{batch['id']}").json()
                if batch["request_counts"]["completed"] >= 1:
                    break
            assert batch["status"] == "in_progress" and batch["request_counts"]["completed"] == 1, batch
            assert client.get("/health").status_code == 200
            assert client.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
            # A hang guard only: the schema alone takes minutes to compile.
            cancelled = wait_for_status(client, batch["id"], {"cancelled"}, timeout_s=120)
            assert cancelled["request_counts"]["completed"] == 1
            assert client.get("/health").status_code == 200
    finally:
        server.stop()
