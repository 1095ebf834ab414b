"""Retrying what did not succeed, through the real app: ``POST /v1/batches/{id}/retry`` makes a
batch over exactly the lines still without a success, linked both ways, idempotently, and
``GET /v1/batches/{id}/merged_results`` gives the best line of every request of a batch and its
retries. In-process servers (the simulated backend, real SQLite and files)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from batchgen.server.api_keys import KeyStore
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import (
    TERMINAL,
    ApiFactory,
    api_error,
    chat_line,
    create_batch,
    file_lines,
    jsonl,
    upload,
    wait_for_status,
)

#: Per attempt; with the server's 3 attempts a line ends failed with probability 0.67**3 = 0.30.
FAILURE_RATE = "0.67"
#: Too many words for ``--max-context-length 50``: that line's error line, on every attempt.
TOO_LONG = "word " * 200


def _results(client: httpx.Client, batch: dict[str, Any]) -> list[dict[str, Any]]:
    """Every result line of an ended batch, its output and error file together."""
    return file_lines(client, batch["output_file_id"]) + file_lines(client, batch["error_file_id"])


def _merged(client: httpx.Client, batch_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/batches/{batch_id}/merged_results")
    assert response.status_code == 200, response.text
    assert int(response.headers["content-length"]) == len(response.content)
    return [json.loads(line) for line in response.content.splitlines()]


def _succeeded(line: dict[str, Any]) -> bool:
    return line["error"] is None and line["response"]["status_code"] < 400


def _retry(
    client: httpx.Client, batch_id: str, body: object = None, key: str | None = None
) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(
        f"/v1/batches/{batch_id}/retry", json=body if body is not None else {}, headers=headers
    )


def test_a_batch_with_30_percent_failures_retried_until_clean_has_one_success_per_request(
    api_factory: ApiFactory,
) -> None:
    api = api_factory("--simulated-failure-rate", FAILURE_RATE)
    lines = [chat_line(f"q{i}", f"question {i}") for i in range(300)]
    raw = jsonl(*lines)
    original = create_batch(api, upload(api, raw)["id"], metadata={"run": "nightly"}, temperature=0.5)
    original = wait_for_status(api, original["id"], {"completed"})
    assert 45 <= original["request_counts"]["failed"] <= 135  # about 30% of 300
    assert original["retry_of"] is None and original["retries"] == []
    made: list[str] = []
    latest = original
    while latest["request_counts"]["failed"]:
        before = {line["custom_id"] for line in _merged(api, original["id"]) if _succeeded(line)}
        response = _retry(api, original["id"])
        assert response.status_code == 200, response.text
        retry = response.json()
        made.append(retry["id"])
        assert retry["retry_of"] == original["id"]
        assert (retry["metadata"], retry["temperature"], retry["endpoint"]) == (
            {"run": "nightly"},
            0.5,
            original["endpoint"],
        )
        # exactly the lines without a success so far, as they were uploaded, in their order
        content = api.get(f"/v1/files/{retry['input_file_id']}/content").content
        assert content == b"".join(
            line for line in raw.splitlines(keepends=True) if json.loads(line)["custom_id"] not in before
        )
        latest = wait_for_status(api, retry["id"], TERMINAL)
        assert latest["status"] == "completed"
        assert len(made) < 20, "the retries never came clean"
    assert api.get(f"/v1/batches/{original['id']}").json()["retries"] == made
    merged = _merged(api, original["id"])
    assert [line["custom_id"] for line in merged] == [line["custom_id"] for line in lines]
    assert all(_succeeded(line) for line in merged)
    # each merged line is the very line its batch wrote (nothing rebuilt or copied into a new file)
    written = {
        json.dumps(line, sort_keys=True)
        for batch_id in [original["id"], *made]
        for line in _results(api, api.get(f"/v1/batches/{batch_id}").json())
    }
    assert all(json.dumps(line, sort_keys=True) in written for line in merged)
    nothing = api_error(_retry(api, original["id"]), 409)
    assert nothing["code"] == "nothing_to_retry"


@given(
    fails=st.lists(st.booleans(), min_size=1, max_size=10),
    cancel=st.booleans(),
    outcomes=st.sampled_from([None, ["failed"], ["not_run"], ["failed", "not_run"], ["not_run", "failed"]]),
)
@settings(max_examples=examples(12))
def _retry_holds_exactly_the_lines_without_a_success(
    api: httpx.Client, fails: list[bool], cancel: bool, outcomes: list[str] | None
) -> None:
    lines = [chat_line(f"r{i}", TOO_LONG if fail else f"hello {i}") for i, fail in enumerate(fails)]
    raw = jsonl(*lines)
    batch = create_batch(api, upload(api, raw)["id"])
    if cancel:
        api.post(f"/v1/batches/{batch['id']}/cancel")
    family = [wait_for_status(api, batch["id"], TERMINAL)]
    wanted = set(outcomes or ["failed", "not_run"])
    for _round in range(2):  # the retry, then a retry judged over the batch and that retry
        best: dict[str, str] = {}
        for member in family:
            for line in _results(api, member):
                outcome = "succeeded" if _succeeded(line) else "failed"
                if best.get(line["custom_id"]) != "succeeded":
                    best[line["custom_id"]] = outcome
        expected = [
            line
            for line in raw.splitlines(keepends=True)
            if best.get(json.loads(line)["custom_id"], "not_run") in wanted
        ]
        body = {} if outcomes is None else {"outcomes": outcomes}
        response = _retry(api, batch["id"], body)
        if not expected:
            assert api_error(response, 409)["code"] == "nothing_to_retry"
            return
        assert response.status_code == 200, response.text
        retry = response.json()
        assert retry["retry_of"] == batch["id"]
        assert retry["request_counts"]["total"] == len(expected)
        assert api.get(f"/v1/files/{retry['input_file_id']}/content").content == b"".join(expected)
        family.append(wait_for_status(api, retry["id"], TERMINAL))
    merged = _merged(api, batch["id"])
    ids = [line["custom_id"] for line in merged]
    assert len(ids) == len(set(ids))
    order = [line["custom_id"] for line in lines]
    assert ids == [custom_id for custom_id in order if custom_id in set(ids)]


def test_a_retry_holds_exactly_the_lines_that_failed_or_never_ran(api_factory: ApiFactory) -> None:
    api = api_factory("--max-context-length", "50", "--simulated-latency-s", "0.02", "--max-pool-size", "2")
    _retry_holds_exactly_the_lines_without_a_success(api)


def test_the_same_key_and_body_give_the_same_retry_and_another_body_is_a_conflict(
    api_factory: ApiFactory,
) -> None:
    api = api_factory("--max-context-length", "50")
    lines = [chat_line("ok"), chat_line("long-1", TOO_LONG), chat_line("long-2", TOO_LONG)]
    batch = wait_for_status(api, create_batch(api, upload(api, jsonl(*lines))["id"])["id"], TERMINAL)
    first = _retry(api, batch["id"], {"outcomes": ["failed"]}, key="again")
    assert first.status_code == 200, first.text
    repeat = _retry(api, batch["id"], {"outcomes": ["failed"]}, key="again")
    assert repeat.json()["id"] == first.json()["id"]
    wait_for_status(api, first.json()["id"], TERMINAL)
    assert _retry(api, batch["id"], {"outcomes": ["failed"]}, key="again").json()["id"] == first.json()["id"]
    assert (
        api_error(_retry(api, batch["id"], {"outcomes": ["not_run"]}, key="again"), 409)["code"] == "conflict"
    )
    # the key names the retry and nothing else: a create with it is a different request
    other = api.post(
        "/v1/batches",
        json={"input_file_id": batch["input_file_id"], "endpoint": batch["endpoint"]},
        headers={"Idempotency-Key": "again"},
    )
    assert api_error(other, 409)["code"] == "conflict"
    assert api.get(f"/v1/batches/{batch['id']}").json()["retries"] == [first.json()["id"]]
    second = _retry(api, batch["id"], key="new-key")
    assert second.status_code == 200 and second.json()["id"] != first.json()["id"]


def test_refusals_are_openai_shaped_4xx(api_factory: ApiFactory) -> None:
    api = api_factory("--simulated-latency-s", "30", "--max-pool-size", "1")
    running = create_batch(api, upload(api, jsonl(chat_line("a"), chat_line("b")))["id"])
    refused = api_error(_retry(api, running["id"]), 409)
    assert refused["code"] == "batch_not_final" and "ended" in refused["message"]
    assert api_error(_retry(api, "batch_nope"), 404)["code"] == "not_found"
    assert api_error(api.get("/v1/batches/batch_nope/merged_results"), 404)["code"] == "not_found"
    api.post(f"/v1/batches/{running['id']}/cancel")
    ended = wait_for_status(api, running["id"], TERMINAL)["id"]
    bad_bodies: list[tuple[object, str | None]] = [
        ({"outcomes": "failed"}, "outcomes"),
        ({"outcomes": ["failed", "succeeded"]}, "outcomes"),
        ({"outcomes": []}, "outcomes"),
        ({"outcomes": ["failed"] * 3}, "outcomes"),
        ({"input_file_id": "file-x"}, "input_file_id"),
        ({"temperature": 9}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_decoding_length": True}, "max_decoding_length"),
        ({"completion_window": None}, "completion_window"),
        ({"completion_window": "forever"}, "completion_window"),
        ({"metadata": ["a"]}, "metadata"),
        ({"output_order": "sideways"}, "output_order"),
        ({"output_order": 3}, "output_order"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": "x"}}, "output_expires_after"),
        ([1, 2], None),
    ]
    for body, param in bad_bodies:
        error = api_error(api.post(f"/v1/batches/{ended}/retry", json=body), 400)
        assert error["param"] == param, (body, error)
    for raw in (
        b"{",
        b'{"outcomes": ["\\ud800"]}',
        b"[" * 100 + b"]" * 100,
        b'{"top_k": 99999999999999999999}',
    ):
        api_error(api.post(f"/v1/batches/{ended}/retry", content=raw), 400)
    assert api.post(f"/v1/batches/{ended}/retry", content=b"x" * 100_000).status_code == 413
    assert api.get(f"/v1/batches/{ended}").json()["retries"] == []


def test_an_expired_batch_retries_the_lines_that_never_ran(api_factory: ApiFactory) -> None:
    api = api_factory("--simulated-latency-s", "0.3", "--max-pool-size", "1", "--error-file", "openai")
    lines = [chat_line(f"e{i}") for i in range(8)]
    batch = create_batch(api, upload(api, jsonl(*lines))["id"], completion_window="1s")
    batch = wait_for_status(api, batch["id"], {"expired"})
    ran = {line["custom_id"] for line in _results(api, batch)}
    assert len(ran) < len(lines)
    retry = _retry(api, batch["id"], {"outcomes": ["not_run"], "completion_window": "1h"}).json()
    assert retry["completion_window"] == "1h"
    expected = [line["custom_id"] for line in lines if line["custom_id"] not in ran]
    assert [line["custom_id"] for line in file_lines(api, retry["input_file_id"])] == expected
    wait_for_status(api, retry["id"], {"completed"})
    assert [line["custom_id"] for line in _merged(api, batch["id"])] == [line["custom_id"] for line in lines]


def test_another_tenants_batch_is_not_found_and_a_retry_stays_in_its_tenant(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    keys = KeyStore(storage / "metadata.sqlite3")
    _, alpha = keys.create_key("alpha")
    _, beta = keys.create_key("beta")
    _, admin = keys.create_key("ops", admin=True)
    with TestClient(in_process_app(storage, "--max-context-length", "50"), timeout=30) as api:
        api.headers["Authorization"] = f"Bearer {alpha}"
        batch = create_batch(api, upload(api, jsonl(chat_line("a", TOO_LONG), chat_line("b")))["id"])
        batch = wait_for_status(api, batch["id"], TERMINAL)
        api.headers["Authorization"] = f"Bearer {beta}"
        assert api_error(_retry(api, batch["id"]), 404)["code"] == "not_found"
        assert api.get(f"/v1/batches/{batch['id']}/merged_results").status_code == 404
        del api.headers["Authorization"]
        assert api.post(f"/v1/batches/{batch['id']}/retry", json={}).status_code == 401
        assert api.get(f"/v1/batches/{batch['id']}/merged_results").status_code == 401
        api.headers["Authorization"] = f"Bearer {admin}"
        retry = _retry(api, batch["id"]).json()  # an admin's retry belongs to the batch's tenant
        api.headers["Authorization"] = f"Bearer {alpha}"
        assert api.get(f"/v1/batches/{retry['id']}").json()["retry_of"] == batch["id"]
        assert api.get(f"/v1/files/{retry['input_file_id']}").status_code == 200
        api.headers["Authorization"] = f"Bearer {beta}"
        assert api.get(f"/v1/batches/{retry['id']}").status_code == 404


def test_the_merged_view_ranks_a_success_over_an_error_and_the_later_attempt_first(
    api_factory: ApiFactory,
) -> None:
    """Errors only: the merged line is the last batch's error; once one succeeds, that success."""
    api = api_factory("--max-context-length", "50", "--simulated-failure-rate", "1")
    batch = wait_for_status(api, create_batch(api, upload(api, jsonl(chat_line("x")))["id"])["id"], TERMINAL)
    retry = wait_for_status(api, _retry(api, batch["id"]).json()["id"], TERMINAL)
    [merged] = _merged(api, batch["id"])
    [retry_line] = _results(api, retry)
    assert merged == retry_line and merged["error"]["code"] == "backend_error"
    head = api.head(f"/v1/batches/{batch['id']}/merged_results")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(
        api.get(f"/v1/batches/{batch['id']}/merged_results").content
    )


def test_a_database_from_before_retries_opens_and_its_batches_can_be_retried(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    with TestClient(in_process_app(storage, "--max-context-length", "50"), timeout=30) as api:
        batch = create_batch(api, upload(api, jsonl(chat_line("a", TOO_LONG), chat_line("b")))["id"])
        batch = wait_for_status(api, batch["id"], TERMINAL)
    with sqlite3.connect(storage / "metadata.sqlite3") as db:  # as a version before retries made it
        db.execute("DROP INDEX idx_batches_retry_of")
        db.execute("ALTER TABLE batches DROP COLUMN retry_of")
    with TestClient(in_process_app(storage, "--max-context-length", "50"), timeout=30) as api:
        assert api.get(f"/v1/batches/{batch['id']}").json()["retry_of"] is None
        retry = _retry(api, batch["id"]).json()
        assert api.get(f"/v1/batches/{batch['id']}").json()["retries"] == [retry["id"]]


def test_a_retry_the_intake_pool_has_no_room_for_is_429_and_makes_nothing(api_factory: ApiFactory) -> None:
    """A retry is admitted like a new batch: with the intake pool full it is a 429 with
    Retry-After, no retry is linked and no input file is left behind; with room again it works."""
    api = api_factory(
        "--max-context-length",
        "50",
        "--max-intake-capacity",
        "4",
        "--simulated-latency-s",
        "30",
        "--max-pool-size",
        "1",
    )
    lines = [chat_line("long-1", TOO_LONG), chat_line("long-2", TOO_LONG)]
    failed = wait_for_status(api, create_batch(api, upload(api, jsonl(*lines))["id"])["id"], TERMINAL)
    inputs_before = _input_files(api)
    filler = create_batch(api, upload(api, jsonl(*(chat_line(f"f{i}") for i in range(4))))["id"])
    refused = _retry(api, failed["id"])
    assert refused.status_code == 429, refused.text
    assert "Retry-After" in refused.headers
    assert api.get(f"/v1/batches/{failed['id']}").json()["retries"] == []
    assert _input_files(api) - inputs_before == {filler["input_file_id"]}  # no retry input left
    api.post(f"/v1/batches/{filler['id']}/cancel")
    wait_for_status(api, filler["id"], TERMINAL)
    assert _retry(api, failed["id"]).status_code == 200


def _input_files(client: httpx.Client) -> set[str]:
    return {file["id"] for file in client.get("/v1/files", params={"purpose": "batch"}).json()["data"]}


def test_a_batch_whose_results_are_gone_is_409_results_missing(api_factory: ApiFactory) -> None:
    """Deleting the input file, or any result file of the family, leaves nothing to judge the
    lines by: both the retry and the merged view are 409 results_missing, and nothing is made."""
    api = api_factory("--max-context-length", "50")
    lines = [chat_line("ok"), chat_line("long-1", TOO_LONG)]
    for gone in ("input_file_id", "output_file_id", "error_file_id"):
        batch = wait_for_status(api, create_batch(api, upload(api, jsonl(*lines))["id"])["id"], TERMINAL)
        if batch[gone] is None:  # this server writes errors into the output file
            continue
        assert api.delete(f"/v1/files/{batch[gone]}").status_code == 200
        inputs_before = _input_files(api)
        assert api_error(_retry(api, batch["id"]), 409)["code"] == "results_missing", gone
        assert (
            api_error(api.get(f"/v1/batches/{batch['id']}/merged_results"), 409)["code"] == "results_missing"
        )
        assert api.get(f"/v1/batches/{batch['id']}").json()["retries"] == []
        assert _input_files(api) == inputs_before


def test_a_retry_keeps_the_originals_output_order_unless_it_sets_its_own(api_factory: ApiFactory) -> None:
    api = api_factory("--max-context-length", "50")
    lines = [chat_line("ok"), chat_line("long-1", TOO_LONG), chat_line("long-2", TOO_LONG)]
    file_id = upload(api, jsonl(*lines))["id"]
    ordered = create_batch(api, file_id, output_order="input")
    wait_for_status(api, ordered["id"], TERMINAL)
    kept = _retry(api, ordered["id"], {"outcomes": ["failed"]})
    assert kept.json()["output_order"] == "input"
    wait_for_status(api, kept.json()["id"], TERMINAL)
    plain = wait_for_status(api, create_batch(api, file_id)["id"], TERMINAL)
    changed = _retry(api, plain["id"], {"output_order": "input"})
    assert changed.status_code == 200, changed.text
    assert changed.json()["output_order"] == "input" and plain["output_order"] == "completion"
