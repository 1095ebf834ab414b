"""Every status code docs/api.md states is the one the server answers.

The markdown is read as it is: each table row and each sentence is a statement, and each status
code it names (4xx, 5xx, 206, 304) governs the clause from the code before it to the code after
it. Every such clause must be held by a claim below (a phrase of the clause and its code), and
every claim's phrase must be in a clause of its own code and of no other, so a page that says
one code where the server answers another (an unknown ``input_file_id`` was once documented as a
400 while the server and the status table said 404) fails here. A claim is checked against the
real app in this process (keys present: alice's and bob's tenants), or names the test that holds
it where a real socket, a lock held by another process or a long wait is needed.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from batchgen.server.api_keys import KeyStore
from tests.conftest import in_process_app
from tests.helpers import chat_line, jsonl, upload, wait_for_status

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"
#: The codes whose statements are checked: every error, and the non-200 successes the page names.
CODES = {"206", "304", "400", "401", "404", "408", "409", "413", "416", "429", "431", "500", "503", "507"}
_CODE = re.compile(r"(?<![\w.\-/^'])(\d{3})(?![\w\-/^'])")


def statements(text: str) -> Iterator[str]:
    """The page's table rows and sentences, whitespace made single spaces; code blocks skipped."""
    text = re.sub(r"```.*?```", " ", text, flags=re.DOTALL)
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        if lines and all(line.startswith("|") for line in lines):
            yield from (" ".join(line.split()) for line in lines)
            continue
        for item in re.split(r"\n(?=- |\d+\. )", block):  # list items apart
            flat = " ".join(item.split())
            yield from (part for part in re.split(r"(?<=[.;])\s+(?=[A-Z`(*])", flat) if part)


def clauses(text: str) -> list[tuple[str, str]]:
    """(code, clause) for every status code a statement names. The text between two codes is cut
    at its last "; " (else its last ", "): what is before the cut belongs to the code before it,
    the rest to the code after it; the text before the first code and after the last is theirs."""
    found: list[tuple[str, str]] = []
    for statement in statements(text):
        mentions = [m for m in _CODE.finditer(statement) if m[1] in CODES]
        cuts = [0]
        for before, after in itertools.pairwise(mentions):
            gap = statement[before.end() : after.start()]
            cut = gap.rfind("; ")
            cut = gap.rfind(", ") if cut < 0 else cut
            cuts.append(before.end() + (cut + 1 if cut >= 0 else len(gap)))
        cuts.append(len(statement))
        found += [(mention[1], statement[cuts[i] : cuts[i + 1]]) for i, mention in enumerate(mentions)]
    return found


@attrs.frozen
class World:
    """One in-process server with keys: alice's batch file, a running batch on it, a finished one."""

    client: TestClient[Litestar]
    alice: dict[str, str]
    bob: dict[str, str]
    file_id: str
    running_file_id: str
    running_id: str
    done_id: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    storage = tmp_path_factory.mktemp("documented") / "storage"
    with TestClient(
        in_process_app(storage, "--simulated-latency-s", "60", "--shutdown-grace-s", "0"), timeout=30
    ) as client:
        store = KeyStore(storage / "metadata.sqlite3")
        alice = {"Authorization": f"Bearer {store.create_key('alice')[1]}"}
        bob = {"Authorization": f"Bearer {store.create_key('bob')[1]}"}
        store.close()
        file_id = upload(client, jsonl(chat_line("a")), headers=alice)["id"]
        running_file_id = upload(client, jsonl(chat_line("a")), headers=alice)["id"]
        body = {"input_file_id": running_file_id, "endpoint": "/v1/chat/completions"}
        running = client.post("/v1/batches", json=body, headers=alice).json()
        done = client.post("/v1/batches", json={**body, "input_file_id": file_id}, headers=alice).json()
        client.post(f"/v1/batches/{done['id']}/cancel", headers=alice)
        client.headers.update(alice)
        wait_for_status(client, done["id"], {"cancelled"})
        client.headers.pop("Authorization")
        yield World(client, alice, bob, file_id, running_file_id, running["id"], done["id"])


Check = Callable[[World], httpx.Response]


def _files(world: World, params: dict[str, str]) -> httpx.Response:
    return world.client.get("/v1/files", params=params, headers=world.alice)


def _upload(world: World, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return world.client.post(
        "/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch"},
        headers={**world.alice, **(headers or {})},
    )


def _create(world: World, **body: Any) -> httpx.Response:
    fields = {"input_file_id": world.file_id, "endpoint": "/v1/chat/completions", **body}
    return world.client.post("/v1/batches", json=fields, headers=world.alice)


def _content(world: World, range_: str) -> httpx.Response:
    return world.client.get(f"/v1/files/{world.file_id}/content", headers={**world.alice, "Range": range_})


def _not_modified(world: World, path: str) -> httpx.Response:
    first = world.client.get(path, headers=world.alice)
    return world.client.get(path, headers={**world.alice, "If-None-Match": first.headers["ETag"]})


def _reused_key(world: World) -> httpx.Response:
    key = {"Idempotency-Key": "documented-statuses"}
    _upload(world, jsonl(chat_line("k1")), key)
    return _upload(world, jsonl(chat_line("k2")), key)


def _tools_in_responses(world: World) -> httpx.Response:
    line = {
        "custom_id": "r",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"input": "hi", "tools": [{}]},
    }
    return _upload(world, jsonl(line))


#: (code, a phrase of the clause that states it, how to check it: a request, or the test file and
#: function that hold it).
CLAIMS: list[tuple[str, str, Check | str]] = [
    ("401", "(else 401 with", lambda w: w.client.get("/v1/files")),
    ("401", "a `/v1` call or `/metrics` without a valid key", lambda w: w.client.get("/metrics")),
    ("404", "another tenant's id is a", lambda w: w.client.get(f"/v1/files/{w.file_id}", headers=w.bob)),
    (
        "404",
        "not in its canonical form",
        "test_route_access.py::test_odd_spellings_over_a_real_socket_are_refused",
    ),
    ("400", "one naming no file ever stored gets a", lambda w: _files(w, {"after": "file-never-stored"})),
    (
        "409",
        "while an active batch uses it",
        lambda w: w.client.delete(f"/v1/files/{w.running_file_id}", headers=w.alice),
    ),
    ("206", "with that part", lambda w: _content(w, "bytes=0-3")),
    ("416", "a range holding no byte of the file", lambda w: _content(w, "bytes=100000-")),
    (
        "400",
        "holds an integer outside the 64-bit signed range",
        lambda w: _create(w, max_decoding_length=2**63),
    ),
    ("400", "Digits of other scripts", lambda w: _files(w, {"limit": "\u0661\u0660"})),
    ("400", "A file that breaks these rules gets a", lambda w: _upload(w, b"not json\n")),
    (
        "400",
        "An upload whose body ends before",
        "test_upload_edges.py::test_an_upload_cut_short_is_refused_and_leaves_nothing",
    ),
    ("413", "Uploads over `--max-upload-bytes` get a", "test_bad_input.py::test_oversized_upload_is_413"),
    ("409", "with a different request,", _reused_key),
    (
        "429",
        "will be queued in full, or gets",
        "test_backpressure.py::test_full_intake_pool_gives_429_then_accepts_after_draining",
    ),
    (
        "400",
        "an empty or longer one gets a",
        lambda w: _upload(w, jsonl(chat_line("a")), {"Idempotency-Key": "k" * 256}),
    ),
    ("400", "one BatchGen does not serve is a", lambda w: _create(w, endpoint="/v1/audio/speech")),
    ("400", "a bad value's", lambda w: _create(w, metadata={"k": 5})),
    ("400", "any other field is a", lambda w: _create(w, unknown_field=1)),
    ("400", "Anything else is a", lambda w: _create(w, output_order="sorted")),
    ("404", 'with `code: "model_not_found"`', lambda w: w.client.get("/v1/models/gpt-none", headers=w.alice)),
    ("400", "for an unknown `input_file_id`", lambda w: _create(w, input_file_id="file-never-stored")),
    (
        "400",
        "also another tenant's file",
        lambda w: w.client.post(
            "/v1/batches",
            json={"input_file_id": w.file_id, "endpoint": "/v1/chat/completions"},
            headers=w.bob,
        ),
    ),
    (
        "400",
        "a file of another purpose",
        lambda w: _create(
            w,
            input_file_id=w.client.post(
                "/v1/files", files={"file": ("x.txt", b"x")}, data={"purpose": "user_data"}, headers=w.alice
            ).json()["id"],
        ),
    ),
    ("400", "an endpoint that differs from", lambda w: _create(w, endpoint="/v1/completions")),
    ("400", "a file that already has an active batch", lambda w: _create(w, input_file_id=w.running_file_id)),
    (
        "503",
        "while the server is unhealthy",
        "test_storage_locked.py::test_every_route_answers_while_another_process_holds_the_database_locked",
    ),
    (
        "429",
        "when the intake pool has no room",
        "test_backpressure.py::test_full_intake_pool_gives_429_then_accepts_after_draining",
    ),
    (
        "429",
        "once other batches drain gets",
        "test_backpressure.py::test_full_intake_pool_gives_429_then_accepts_after_draining",
    ),
    (
        "429",
        "whenever waiting helps",
        "test_backpressure.py::test_full_intake_pool_gives_429_then_accepts_after_draining",
    ),
    (
        "429",
        "on a 429 is an estimate",
        "test_backpressure.py::test_full_intake_pool_gives_429_then_accepts_after_draining",
    ),
    (
        "304",
        "Not Modified` while the batch is unchanged",
        lambda w: _not_modified(w, f"/v1/batches/{w.running_id}"),
    ),
    ("304", "for `If-None-Match`, as a batch is", lambda w: _not_modified(w, "/v1/pool/status")),
    (
        "409",
        "a batch that ended any other way answers",
        "test_bad_input.py::test_cancel_of_a_finished_batch_is_409",
    ),
    (
        "503",
        "(503 with `Retry-After`)",
        "test_storage_locked.py::test_every_route_answers_while_another_process_holds_the_database_locked",
    ),
    (
        "503",
        "batches for an unavailable model are refused with",
        "test_several_models.py::test_a_failing_model_fails_only_its_own_batches",
    ),
    (
        "503",
        "its batches are refused",
        "test_several_models.py::test_a_failing_model_fails_only_its_own_batches",
    ),
    (
        "400",
        "Checks at create",
        "test_several_models.py::test_a_file_uploaded_for_a_model_no_longer_served_is_refused_at_create",
    ),
    ("400", "Refused at upload with a", _tools_in_responses),
    ("400", "means a line using it is a", lambda w: _upload(w, jsonl(chat_line("a", n=2)))),
    (
        "503",
        "beyond this many open connections",
        "test_connection_limits.py::test_connections_beyond_the_limit_get_503",
    ),
    (
        "431",
        "a larger head is answered",
        "test_connection_limits.py::test_the_head_size_limit_is_the_flag_exactly",
    ),
    (
        "400",
        "Framing is unambiguous",
        "test_connection_limits.py::test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed",
    ),
    (
        "503",
        "an upload still arriving is cut",
        "test_connection_limits.py::test_a_request_under_way_at_shutdown_is_cut_with_503_when_the_grace_ends",
    ),
    (
        "408",
        "the request is answered",
        "test_connection_limits.py::test_a_stalled_upload_is_cut_with_408_and_leaves_nothing",
    ),
    ("400", "| 400 | bad input", lambda w: _create(w, input_file_id=w.running_file_id)),
    ("401", "| 401 | once API keys exist", lambda w: w.client.get("/v1/batches")),
    (
        "404",
        "| 404 | unknown file or batch id",
        lambda w: w.client.get("/v1/batches/batch_never", headers=w.alice),
    ),
    ("409", "an `Idempotency-Key` reused for a different request", _reused_key),
    (
        "408",
        "| 408 | no part of a request body",
        "test_connection_limits.py::test_a_stalled_upload_is_cut_with_408_and_leaves_nothing",
    ),
    ("413", "| 413 | upload over", "test_bad_input.py::test_oversized_upload_is_413"),
    # the Uploads API (docs/api.md, "Uploads: files of many gigabytes, in parts")
    (
        "400",
        "whose sizes add up to `bytes` exactly",
        "test_chunked_uploads.py::test_bounds_are_clear_errors_that_store_nothing",
    ),
    (
        "400",
        "a mismatch is a 400 `md5_mismatch`",
        "test_chunked_uploads.py::test_an_md5_that_does_not_match_stores_nothing_and_the_right_one_completes",
    ),
    (
        "400",
        "adding parts is a 400 `upload_completed`",
        "test_chunked_uploads.py::test_an_md5_that_does_not_match_stores_nothing_and_the_right_one_completes",
    ),
    (
        "413",
        "a part over 64 MiB is a 413",
        "test_chunked_uploads.py::test_a_part_over_64_mib_is_refused_unread",
    ),
    (
        "400",
        "64 MiB) is a 400",
        "test_chunked_uploads.py::test_bounds_are_clear_errors_that_store_nothing",
    ),
    (
        "400",
        "one more is a 400 naming the flag",
        "test_chunked_uploads.py::test_bounds_are_clear_errors_that_store_nothing",
    ),
    (
        "429",
        "one more create is a 429 `too_many_open_uploads`",
        "test_chunked_uploads.py::test_a_tenant_with_as_many_open_uploads_as_allowed_gets_429_naming_the_flag",
    ),
    (
        "413",
        "413 `quota_exceeded` when that file would pass it",
        "test_stored_bytes_quota.py::test_a_retry_stores_its_input_only_within_the_owners_bytes",
    ),
    (
        "400",
        "`bytes` over `--max-upload-total-bytes` is a 400",
        "test_chunked_uploads.py::test_bounds_are_clear_errors_that_store_nothing",
    ),
    (
        "400",
        "`upload_cancelled` or `upload_expired`",
        "test_chunked_uploads.py::test_cancel_deletes_the_parts_and_refuses_more",
    ),
    (
        "400",
        'anything else is a 400 with `param: "expires_after"`',
        "test_chunked_uploads.py::test_an_uploads_expires_after_is_read_and_bounded_as_the_files_one",
    ),
    (
        "400",
        "a late part gets a 400 `upload_completed`",
        "test_chunked_uploads.py::test_an_upload_expiring_or_cancelled_while_it_completes_never_loses_its_parts",
    ),
    (
        "400",
        "whose `status_code` is 400 or more), wherever that line is kept",
        "test_replica_counts.py::test_a_batch_with_error_lines_has_the_same_counts_on_one_server_and_on_replicas",
    ),
    (
        "404",
        "Another tenant's upload is a 404",
        "test_chunked_uploads.py::test_another_tenants_upload_is_not_found_and_quota_counts_pending_parts",
    ),
    (
        "413",
        "gets a 413 `quota_exceeded`",
        "test_chunked_uploads.py::test_another_tenants_upload_is_not_found_and_quota_counts_pending_parts",
    ),
    (
        "507",
        "A full disk fails only the call that hit it",
        "test_chunked_uploads_live.py::test_a_full_disk_fails_only_the_part_that_hit_it",
    ),
    # retrying what did not succeed (docs/api.md, "Retrying what did not succeed")
    (
        "404",
        "another tenant's batch is a 404",
        "test_batch_retry.py::test_another_tenants_batch_is_not_found_and_a_retry_stays_in_its_tenant",
    ),
    (
        "400",
        "whose `status_code` is below",
        "test_batch_retry.py::test_the_merged_view_ranks_a_success_over_an_error_and_the_later_attempt_first",
    ),
    (
        "400",
        "or a `status_code` of",
        "test_batch_retry.py::test_the_merged_view_ranks_a_success_over_an_error_and_the_later_attempt_first",
    ),
    ("400", "Any other field is a", "test_batch_retry.py::test_refusals_are_openai_shaped_4xx"),
    ("413", " 413 beyond)", "test_batch_retry.py::test_refusals_are_openai_shaped_4xx"),
    ("409", "(`batch_not_final`)", "test_batch_retry.py::test_refusals_are_openai_shaped_4xx"),
    (
        "429",
        "A retry is admitted like any new batch",
        "test_batch_retry.py::test_a_retry_the_intake_pool_has_no_room_for_is_429_and_makes_nothing",
    ),
    (
        "409",
        "the same key with another body, or a key already used for another call",
        "test_batch_retry.py::test_the_same_key_and_body_give_the_same_retry_and_another_body_is_a_conflict",
    ),
    ("404", "It answers", "test_batch_retry.py::test_refusals_are_openai_shaped_4xx"),
    (
        "409",
        "`results_missing` as above",
        "test_batch_retry.py::test_a_batch_whose_results_are_gone_is_409_results_missing",
    ),
    ("416", "| 416 | a `Range` holding no byte", lambda w: _content(w, "bytes=-0")),
    (
        "429",
        "| 429 | the intake pool cannot take",
        "test_tenants.py::test_a_tenant_over_its_own_limits_is_refused_naming_them",
    ),
    (
        "429",
        "let in once its earlier batches have drained",
        "test_tenant_limit_never_fits.py::test_a_batch_the_limits_let_in_once_earlier_batches_drain_is_429_with_retry_after",
    ),
    (
        "400",
        "larger than the tenant's `max_queued_requests` itself",
        "test_tenant_limit_never_fits.py::test_a_batch_the_tenants_limits_can_never_let_in_is_400_and_one_that_can_is_never_400",
    ),
    (
        "431",
        "| 431 | request line and headers",
        "test_connection_limits.py::test_a_100000_byte_header_is_refused_under_the_default_64_kib_limit",
    ),
    (
        "503",
        "| 503 | creating a batch while the server is unhealthy",
        "test_storage_locked.py::test_every_route_answers_while_another_process_holds_the_database_locked",
    ),
]


def test_every_documented_status_is_held_by_a_claim() -> None:
    unheld = [
        (code, clause)
        for code, clause in clauses(API_DOC.read_text())
        if not any(code == claim_code and phrase in clause for claim_code, phrase, _ in CLAIMS)
    ]
    assert not unheld, "docs/api.md states statuses no claim here checks:\n" + "\n".join(map(str, unheld))


@pytest.mark.parametrize(
    ("code", "phrase"), [(code, phrase) for code, phrase, _ in CLAIMS], ids=lambda v: v[:40]
)
def test_every_claim_is_what_the_page_says(code: str, phrase: str) -> None:
    found = clauses(API_DOC.read_text())
    assert any(code == c and phrase in clause for c, clause in found), (
        f"{phrase!r} is no longer a {code} clause"
    )
    others = sorted({c for c, clause in found if phrase in clause and c != code})
    assert not others, f"{phrase!r} is also stated with {others}"


_CHECKS = [(code, phrase, check) for code, phrase, check in CLAIMS if not isinstance(check, str)]


@pytest.mark.parametrize(("code", "phrase", "check"), _CHECKS, ids=[phrase[:40] for _, phrase, _ in _CHECKS])
def test_the_server_answers_the_documented_status(world: World, code: str, phrase: str, check: Check) -> None:
    response = check(world)
    assert str(response.status_code) == code, (phrase, response.status_code, response.text[:300])
    if code >= "400":
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}


_HELD = sorted({check for _, _, check in CLAIMS if isinstance(check, str)})


@pytest.mark.parametrize("held_by", _HELD)
def test_a_claim_held_elsewhere_names_a_test_that_exists(held_by: str) -> None:
    file_name, function = held_by.split("::")
    tree = ast.parse((ROOT / "tests" / "server" / file_name).read_text())
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert function in names, held_by
    codes = {code for code, _, check in CLAIMS if check == held_by}
    source = (ROOT / "tests" / "server" / file_name).read_text()
    assert all(code in source for code in codes), (held_by, codes)
