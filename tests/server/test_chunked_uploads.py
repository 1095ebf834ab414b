"""The Uploads API (``POST /v1/uploads``, parts, complete, cancel, expiry) through the real app.

Parts of any sizes, sent in any order, complete to exactly the bytes of the order ``complete``
names (Hypothesis); lines cut across parts are validated as one file, and a bad line is named by
its line number in the whole file; an md5 that does not match, too many parts, a part too large
and parts that do not add up to the declared size are clear 400/413s that store nothing; cancel
and expiry delete the parts, but never under a complete at work (one paused where it reads the
parts completes, or is refused and the upload then expires); ``expires_after`` is read and bounded
as ``POST /v1/files`` reads it, and sets the lifetime of the file made; another tenant's upload is
a 404, and a tenant's quota counts the parts of its pending uploads.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.errors import InvalidBatchFile
from batchgen.core.files import chunked_uploads
from batchgen.core.files.batch_file import validate_batch_file
from batchgen.core.files.catalogue import MAX_FILE_EXPIRY_S
from tests.examples import examples
from tests.helpers import api_error, chat_line, jsonl
from tests.keys import authorized, create_key
from tests.live import LiveServer


def create_upload(client: httpx.Client, size: int, purpose: str = "batch") -> dict[str, Any]:
    response = client.post(
        "/v1/uploads",
        json={"bytes": size, "filename": "big.jsonl", "mime_type": "text/jsonl", "purpose": purpose},
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def post_part(client: httpx.Client, upload_id: str, data: bytes) -> httpx.Response:
    return client.post(f"/v1/uploads/{upload_id}/parts", files={"data": ("blob", data)})


def add_part(client: httpx.Client, upload_id: str, data: bytes) -> str:
    response = post_part(client, upload_id, data)
    assert response.status_code == 200, response.text
    part: dict[str, Any] = response.json()
    assert part["object"] == "upload.part" and part["upload_id"] == upload_id
    return str(part["id"])


def complete(
    client: httpx.Client, upload_id: str, part_ids: list[str], md5: str | None = None
) -> httpx.Response:
    body: dict[str, Any] = {"part_ids": part_ids}
    if md5 is not None:
        body["md5"] = md5
    return client.post(f"/v1/uploads/{upload_id}/complete", json=body)


def file_ids(client: httpx.Client) -> set[str]:
    """The uploaded files (batch results, which batches of earlier examples may still be adding,
    left out)."""
    files = client.get("/v1/files").json()["data"]
    return {file["id"] for file in files if file["purpose"] != "batch_output"}


def _cut(data: bytes, points: list[int]) -> list[bytes]:
    cuts = sorted({point % (len(data) + 1) for point in points} - {0, len(data)})
    return [data[start:stop] for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def upload_folder(storage: Path, upload_id: str) -> list[str]:
    return sorted(path.name for path in (storage / "uploads" / upload_id).iterdir())


_SETTINGS = settings(
    max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(
    groups=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    arrival=st.randoms(use_true_random=False),
    order=st.randoms(use_true_random=False),
)
def test_parts_sent_in_any_order_complete_to_the_bytes_of_the_order_named(
    api: httpx.Client, groups: list[int], arrival: Any, order: Any
) -> None:
    # each part holds whole lines, so every order of them is a valid file of its own bytes
    parts, count = [], 0
    for size in groups:
        parts.append(jsonl(*[chat_line(f"line-{count + i}", "x" * (count + i)) for i in range(size)]))
        count += size
    upload = create_upload(api, sum(map(len, parts)))
    assert upload["status"] == "pending" and upload["object"] == "upload"
    sending = list(range(len(parts)))
    arrival.shuffle(sending)
    ids = {index: add_part(api, upload["id"], parts[index]) for index in sending}
    named = list(range(len(parts)))
    order.shuffle(named)
    response = complete(api, upload["id"], [ids[index] for index in named])
    assert response.status_code == 200, response.text
    done = response.json()
    assert done["status"] == "completed" and done["file"]["purpose"] == "batch"
    expected = b"".join(parts[index] for index in named)
    assert done["file"]["bytes"] == len(expected)
    assert api.get(f"/v1/files/{done['file']['id']}/content").content == expected


@_SETTINGS
@given(
    count=st.integers(1, 60),
    bad=st.one_of(st.none(), st.integers(0, 59)),
    points=st.lists(st.integers(0, 100_000), max_size=6),
)
def test_lines_across_part_boundaries_are_one_file_and_a_bad_line_is_named_by_its_number(
    api: httpx.Client, count: int, bad: int | None, points: list[int]
) -> None:
    lines: list[object] = [chat_line(f"id-{i}", f"question {i} " * (i % 7)) for i in range(count)]
    if bad is not None and bad < count:
        lines[bad] = chat_line(f"id-{bad}", temperature=7)
    data = jsonl(*lines)
    before = file_ids(api)
    upload = create_upload(api, len(data))
    part_ids = [add_part(api, upload["id"], part) for part in _cut(data, points)]
    response = complete(api, upload["id"], part_ids)
    if bad is not None and bad < count:
        error = api_error(response, 400)
        assert error["code"] == "invalid_batch_file"
        assert error["message"].startswith(f"Invalid batch input file: line {bad + 1}: ")
        assert file_ids(api) == before  # nothing served
        assert api.post(f"/v1/uploads/{upload['id']}/cancel").json()["status"] == "cancelled"
        return
    assert response.status_code == 200, response.text
    file = response.json()["file"]
    assert api.get(f"/v1/files/{file['id']}/content").content == data
    batch = api.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions"})
    assert batch.status_code == 200, batch.text
    assert batch.json()["request_counts"]["total"] == count


@settings(
    max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    count=st.integers(1, 300),
    bad=st.integers(0, 299),
    model=st.sampled_from(["default", "not-served"]),
    points=st.lists(st.integers(0, 100_000), max_size=4),
)
def test_the_validation_worker_process_names_the_same_lines(
    api: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
    count: int,
    bad: int,
    model: str,
    points: list[int],
) -> None:
    """Uploads past ``WORKER_MIN_BYTES`` are validated in a worker process, which gets a copy of
    the served models: a model not served, a bad field and a duplicate id are named there too."""
    monkeypatch.setattr(chunked_uploads, "WORKER_MIN_BYTES", 0)
    lines: list[object] = [chat_line(f"w-{i}", f"question {i}") for i in range(count)]
    if bad < count:
        lines[bad] = chat_line(f"w-{max(bad - 1, 0)}", model=model)  # a duplicate id, maybe a bad model
    data = jsonl(*lines)
    upload = create_upload(api, len(data))
    part_ids = [add_part(api, upload["id"], part) for part in _cut(data, points)]
    response = complete(api, upload["id"], part_ids)
    path = tmp_path_factory.mktemp("worker") / "input.jsonl"
    path.write_bytes(data)
    try:  # what the server's own validation of a plain upload says of the same bytes
        validate_batch_file(str(path), api.app.state["service"].model_set)  # type: ignore[attr-defined]
    except InvalidBatchFile as exc:
        assert bad < count and (bad > 0 or model != "default")
        error = api_error(response, 400)
        assert error["message"] == str(exc) and error["message"].startswith(
            f"Invalid batch input file: line {bad + 1}: "
        )
        return
    assert response.status_code == 200, response.text
    assert api.get(f"/v1/files/{response.json()['file']['id']}/content").content == data


@_SETTINGS
@given(
    in_worker=st.booleans(),
    bom=st.booleans(),
    points=st.lists(st.integers(0, 100_000), max_size=5),
    wrong=st.sampled_from(["no", "one byte more", "without the bom"]),
)
def test_the_md5_of_parts_validated_as_they_arrived_is_their_bytes_md5(
    api: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
    in_worker: bool,
    bom: bool,
    points: list[int],
    wrong: str,
) -> None:
    """Completed in the order the parts arrived, the md5 is the one their validation computed as
    they arrived (in a worker process or a thread): that of every byte sent, a byte order mark
    included, and a wrong one still stores nothing."""
    monkeypatch.setattr(chunked_uploads, "WORKER_MIN_BYTES", 0 if in_worker else 1 << 40)
    data = (b"\xef\xbb\xbf" if bom else b"") + jsonl(*[chat_line(f"d-{i}") for i in range(30)])
    upload = create_upload(api, len(data))
    ids = [add_part(api, upload["id"], part) for part in _cut(data, points)]
    named = {
        "no": data,
        "one byte more": data + b"x",
        "without the bom": data.removeprefix(b"\xef\xbb\xbf") if bom else data[1:],
    }[wrong]
    answer = complete(api, upload["id"], ids, md5=hashlib.md5(named).hexdigest())
    if wrong != "no":
        assert api_error(answer, 400)["code"] == "md5_mismatch"
        answer = complete(api, upload["id"], ids, md5=hashlib.md5(data).hexdigest())
    assert answer.status_code == 200, answer.text
    stored = api.get(f"/v1/files/{answer.json()['file']['id']}/content").content
    assert stored == data.removeprefix(b"\xef\xbb\xbf")


def test_an_md5_that_does_not_match_stores_nothing_and_the_right_one_completes(api: httpx.Client) -> None:
    data = jsonl(*[chat_line(f"m-{i}") for i in range(20)])
    upload = create_upload(api, len(data))
    first, second = data[: len(data) // 2], data[len(data) // 2 :]
    ids = [add_part(api, upload["id"], first), add_part(api, upload["id"], second)]
    before = file_ids(api)
    error = api_error(complete(api, upload["id"], ids, md5=hashlib.md5(data + b"x").hexdigest()), 400)
    assert error["code"] == "md5_mismatch" and error["param"] == "md5"
    # the parts in the wrong order are not the file the md5 names either
    api_error(complete(api, upload["id"], ids[::-1], md5=hashlib.md5(data).hexdigest()), 400)
    assert file_ids(api) == before
    done = complete(api, upload["id"], ids, md5=hashlib.md5(data).hexdigest())
    assert done.status_code == 200, done.text
    assert api.get(f"/v1/files/{done.json()['file']['id']}/content").content == data
    # completing again (an answer lost on the way) gives the same file; more parts are refused
    assert complete(api, upload["id"], ids).json()["file"]["id"] == done.json()["file"]["id"]
    assert api_error(post_part(api, upload["id"], b"more"), 400)["code"] == "upload_completed"


def test_cancel_deletes_the_parts_and_refuses_more(
    api_factory: Callable[..., httpx.Client], tmp_path: Path
) -> None:
    client = api_factory()
    upload = create_upload(client, 100)
    part = add_part(client, upload["id"], b"x" * 40)
    assert upload_folder(tmp_path / "storage", upload["id"]) == [
        "arrived.index",
        "arrived.log",
        "upload.json",
    ]
    cancelled = client.post(f"/v1/uploads/{upload['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert upload_folder(tmp_path / "storage", upload["id"]) == ["upload.json"]
    assert api_error(post_part(client, upload["id"], b"y"), 400)["code"] == "upload_cancelled"
    assert api_error(complete(client, upload["id"], [part]), 400)["code"] == "upload_cancelled"
    assert api_error(client.post(f"/v1/uploads/{upload['id']}/cancel"), 400)["code"] == "upload_cancelled"


def test_an_upload_not_completed_in_time_expires_and_its_parts_are_deleted(
    api_factory: Callable[..., httpx.Client], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The API's clock counts whole seconds, so an upload made at 12.9 s with a 1 s expiry expires
    # at 13 s: the test holds the uploads' clock still while it adds a part, then moves it on.
    clock = [int(time.time())]
    monkeypatch.setattr(chunked_uploads, "now", lambda: clock[0])
    client = api_factory("--upload-expiry-s", "1")
    upload = create_upload(client, 100)
    assert upload["created_at"] == clock[0] and upload["expires_at"] == clock[0] + 1
    part = add_part(client, upload["id"], jsonl(chat_line("e-1"))[:50])
    assert upload_folder(tmp_path / "storage", upload["id"]) != ["upload.json"]  # its part is kept
    clock[0] += 1
    deadline = time.monotonic() + 60
    while upload_folder(tmp_path / "storage", upload["id"]) != ["upload.json"]:  # the maintenance loop
        assert time.monotonic() < deadline, "the parts of an expired upload were not deleted"
        time.sleep(0.1)
    assert api_error(post_part(client, upload["id"], b"y"), 400)["code"] == "upload_expired"
    assert api_error(complete(client, upload["id"], [part]), 400)["code"] == "upload_expired"


def test_bounds_are_clear_errors_that_store_nothing(
    api_factory: Callable[..., httpx.Client], tmp_path: Path
) -> None:
    client = api_factory("--max-upload-total-bytes", "1000", "--max-upload-parts", "3")
    assert api_error(create_upload_response(client, 1001), 400)["param"] == "bytes"
    for size in (0, -1, True, "10", 10**18):
        assert api_error(create_upload_response(client, size), 400)["param"] == "bytes"
    upload = create_upload(client, 100, purpose="user_data")  # not validated: any bytes
    # more bytes than declared and one part more (a part a retry sent twice): 200 here
    assert api_error(post_part(client, upload["id"], b"x" * 201), 400)["param"] == "data"
    first = add_part(client, upload["id"], b"x" * 60)
    twice = add_part(client, upload["id"], b"x" * 60)
    assert api_error(post_part(client, upload["id"], b"x" * 81), 400)["param"] == "data"
    # parts that do not add up to the declared size
    error = api_error(complete(client, upload["id"], [first]), 400)
    assert error["param"] == "part_ids" and "bytes=100" in error["message"]
    assert api_error(complete(client, upload["id"], [first, twice]), 400)["param"] == "part_ids"
    assert api_error(complete(client, upload["id"], [first, first]), 400)["param"] == "part_ids"
    assert api_error(complete(client, upload["id"], ["part_nope"]), 400)["param"] == "part_ids"
    assert api_error(complete(client, upload["id"], []), 400)["param"] == "part_ids"
    assert api_error(client.post(f"/v1/uploads/{upload['id']}/complete", json={"part_ids": "x"}), 400)
    # too many parts (--max-upload-parts)
    last = add_part(client, upload["id"], b"x" * 40)
    message = api_error(post_part(client, upload["id"], b"x"), 400)["message"]
    assert "at most 3 parts" in message and "--max-upload-parts" in message
    folder = tmp_path / "storage" / "uploads" / upload["id"]
    assert upload_folder(tmp_path / "storage", upload["id"]) == [
        "arrived.index",
        "arrived.log",
        "upload.json",
    ]
    # three parts, one after another in the log; nothing of the parts refused is kept
    assert (folder / "arrived.log").stat().st_size == 160
    assert len((folder / "arrived.index").read_text().splitlines()) == 3
    assert file_ids(client) == set()
    # the parts named add up: the file is made, and the part not named is deleted
    done = complete(client, upload["id"], [twice, last])
    assert done.status_code == 200, done.text
    assert done.json()["file"]["bytes"] == 100
    assert upload_folder(tmp_path / "storage", upload["id"]) == ["upload.json"]


def test_a_part_over_64_mib_is_refused_unread(api: httpx.Client) -> None:
    upload = create_upload(api, 8 * 1024**3)
    big = chunked_uploads.MAX_PART_BYTES + 1
    error = api_error(post_part(api, upload["id"], b"\0" * big), 413)
    assert error["code"] == "file_too_large"


def create_upload_response(client: httpx.Client, size: object) -> httpx.Response:
    return client.post(
        "/v1/uploads",
        json={"bytes": size, "filename": "big.jsonl", "mime_type": "text/jsonl", "purpose": "batch"},
    )


def test_another_tenants_upload_is_not_found_and_quota_counts_pending_parts(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    storage = tmp_path / "storage"
    _, alice_key = create_key(storage, "alice", "--max-stored-bytes", "1000")
    _, bob_key = create_key(storage, "bob")
    server = server_factory(storage="storage")
    with authorized(server.base_url, alice_key) as alice, authorized(server.base_url, bob_key) as bob:
        upload = create_upload(alice, 600)
        part = add_part(alice, upload["id"], b"x" * 500)
        for response in (
            post_part(bob, upload["id"], b"y"),
            complete(bob, upload["id"], [part]),
            bob.post(f"/v1/uploads/{upload['id']}/cancel"),
        ):
            assert api_error(response, 404)["code"] == "not_found"
        # 500 bytes pending: a new upload, a new part or a plain file that would pass 1000 is refused
        assert api_error(create_upload_response(alice, 501), 413)["code"] == "quota_exceeded"
        second = create_upload(alice, 500)
        add_part(alice, second["id"], b"x" * 450)
        # 950 bytes pending: 51 more would pass the limit, though both uploads have room for them
        assert api_error(post_part(alice, upload["id"], b"x" * 51), 413)["code"] == "quota_exceeded"
        plain = alice.post(
            "/v1/files", files={"file": ("a.jsonl", jsonl(chat_line("q")) * 1)}, data={"purpose": "batch"}
        )
        assert api_error(plain, 413)["code"] == "quota_exceeded"
        # cancelling frees the space
        alice.post(f"/v1/uploads/{second['id']}/cancel").raise_for_status()
        add_part(alice, upload["id"], b"x" * 100)
        assert bob.post("/v1/uploads/nonexistent/cancel").status_code == 404


def _lock_waiters(client: Any, upload_id: str) -> int:
    """Calls waiting for the upload's lock in the in-process server (a cancel, a part being added)."""
    uploads = client.app.state["service"].parts.uploads
    lock = uploads._locks.get(upload_id)
    return 0 if lock is None else int(lock.statistics().tasks_waiting)


@pytest.mark.parametrize("valid", [True, False], ids=["valid", "a bad line"])
@pytest.mark.parametrize("action", ["a part arrives", "a read", "maintenance", "cancel"])
def test_an_upload_expiring_or_cancelled_while_it_completes_never_loses_its_parts(
    api_factory: Callable[..., httpx.Client],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    action: str,
    valid: bool,
) -> None:
    """A complete is paused where it reads the parts; the upload's ``expires_at`` passes and it is
    expired (a part arriving, a read, the maintenance job) or cancelled. The complete holds the
    upload: it makes the file and the upload is completed (the other call is refused with
    ``upload_completed``), or it is refused for its bad line and the upload then expires (or is
    refused as expired). Never a 500, never parts deleted under it, never a half-made upload."""
    clock = [int(time.time())]
    monkeypatch.setattr(chunked_uploads, "now", lambda: clock[0])
    reading, resume = threading.Event(), threading.Event()
    validate = chunked_uploads.validate_chunks

    def paused_validation(*args: Any, **kwargs: Any) -> Any:
        reading.set()
        if not resume.wait(60):
            raise TimeoutError("the test did not resume the complete")
        return validate(*args, **kwargs)

    monkeypatch.setattr(chunked_uploads, "validate_chunks", paused_validation)
    client: Any = api_factory("--upload-expiry-s", "1")
    service = client.app.state["service"]
    storage = tmp_path / "storage"
    first = jsonl(*[chat_line(f"r-{i}") for i in range(5)])
    second = jsonl(*[chat_line(f"s-{i}", temperature=2 if valid else 7) for i in range(5)])
    upload = create_upload(client, len(first) + len(second))
    ids = [add_part(client, upload["id"], first), add_part(client, upload["id"], second)]
    answers: dict[str, httpx.Response] = {}

    def call(name: str, request: Callable[[], httpx.Response]) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(name, request()), daemon=True)
        thread.start()
        return thread

    # named in another order than they arrived: validation reads every part at complete
    completing = call("complete", lambda: complete(client, upload["id"], ids[::-1]))
    assert reading.wait(60), "the complete never reached its validation"
    clock[0] += 5  # past expires_at, while the complete is at work
    other: threading.Thread | None = None
    if action == "a part arrives":
        other = call(action, lambda: post_part(client, upload["id"], b"late"))
    elif action == "cancel":
        other = call(action, lambda: client.post(f"/v1/uploads/{upload['id']}/cancel"))
    elif action == "a read":
        client.blocking_portal.call(service.get_upload, upload["id"])
    else:
        client.blocking_portal.call(service.parts.uploads.expire_due)
    deadline = time.monotonic() + 60
    # a part or a cancel has reached the upload (and waits for it) or was answered already
    while other is not None and other.is_alive():
        if client.blocking_portal.call(_lock_waiters, client, upload["id"]):
            break
        assert time.monotonic() < deadline, f"{action}: never reached the upload"
        time.sleep(0.02)
    resume.set()
    for thread in (completing, other):
        if thread is not None:
            thread.join(60)
            assert not thread.is_alive()
    done = answers["complete"]
    final = client.blocking_portal.call(service.get_upload, upload["id"])
    if valid:
        assert done.status_code == 200, done.text
        assert done.json()["status"] == final.status == "completed"
        file = done.json()["file"]
        assert client.get(f"/v1/files/{file['id']}/content").content == second + first
        assert file_ids(client) == {file["id"]}
        if action in answers:
            assert api_error(answers[action], 400)["code"] == "upload_completed"
    else:
        assert api_error(done, 400)["code"] == "invalid_batch_file"
        if action in answers:
            assert api_error(answers[action], 400)["code"] == "upload_expired"
        assert final.status == "expired"  # now that the complete is done
        assert api_error(complete(client, upload["id"], ids), 400)["code"] == "upload_expired"
        assert file_ids(client) == set()
    assert upload_folder(storage, upload["id"]) == ["upload.json"]


def _made_by_upload(client: httpx.Client, expires_after: object) -> httpx.Response:
    """Create an upload with ``expires_after`` (left out when None) and, when that is taken,
    complete it with one part; the answer that refused it, or the completed upload."""
    body: dict[str, Any] = {"bytes": 0, "filename": "a.jsonl", "mime_type": "text/jsonl", "purpose": "batch"}
    data = jsonl(chat_line("x-1"))
    body["bytes"] = len(data)
    if expires_after is not None:
        body["expires_after"] = expires_after
    created = client.post("/v1/uploads", json=body)
    if created.status_code != 200:
        return created
    upload_id = created.json()["id"]
    return complete(client, upload_id, [add_part(client, upload_id, data)])


_SECONDS = st.one_of(
    st.integers(-3, 3),
    st.integers(MAX_FILE_EXPIRY_S - 2, MAX_FILE_EXPIRY_S + 2),
    st.integers(10**17, 2**63 - 1),  # past that a JSON body is refused whole (json_bodies)
    st.text(alphabet="0123456789 -+.e\u0663\uff13", max_size=6),  # digits of other scripts too
)


@_SETTINGS
@given(anchor=st.sampled_from([None, "created_at", "last_active_at", ""]), seconds=_SECONDS)
def test_an_uploads_expires_after_is_read_and_bounded_as_the_files_one(
    api: httpx.Client, anchor: str | None, seconds: int | str
) -> None:
    """``expires_after`` of ``POST /v1/uploads`` (JSON) is taken or refused exactly as the same
    value in ``POST /v1/files``' form fields, with the same 400; taken, the file the upload makes
    expires that many seconds after it is made."""
    fields = {"purpose": "batch", "expires_after[seconds]": str(seconds)}
    if anchor is not None:
        fields["expires_after[anchor]"] = anchor
    plain = api.post("/v1/files", files={"file": ("a.jsonl", jsonl(chat_line("x-1")))}, data=fields)
    answer = _made_by_upload(
        api, {"seconds": seconds} if anchor is None else {"anchor": anchor, "seconds": seconds}
    )
    if plain.status_code != 200:
        error = api_error(answer, 400)
        assert error == api_error(plain, 400) and error["param"] == "expires_after"
        return
    assert answer.status_code == 200, answer.text
    made, file = plain.json(), answer.json()["file"]
    assert file["expires_at"] - file["created_at"] == made["expires_at"] - made["created_at"]
    assert file["expires_at"] - file["created_at"] == int(str(seconds).strip())


def test_an_expires_after_that_is_not_an_object_of_anchor_and_seconds_is_refused(api: httpx.Client) -> None:
    values: list[object] = ["3600", 3600, [], {}, {"anchor": "created_at"}, {"seconds": 60, "days": 1}, True]
    for value in values:
        error = api_error(_made_by_upload(api, value), 400)
        assert error["param"] == "expires_after", value
    # left out (or null), the file keeps the server's lifetime: here, none
    assert _made_by_upload(api, None).json()["file"]["expires_at"] is None


def test_a_tenant_with_as_many_open_uploads_as_allowed_gets_429_naming_the_flag(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """``--max-open-uploads`` bounds each tenant's pending uploads: one more is 429 with a
    Retry-After, naming the flag; another tenant is not held back, and completing or cancelling
    one makes room again."""
    storage = tmp_path / "storage"
    _, alice_key = create_key(storage, "alice")
    _, bob_key = create_key(storage, "bob")
    server = server_factory("--max-open-uploads", "2", storage="storage")
    with authorized(server.base_url, alice_key) as alice, authorized(server.base_url, bob_key) as bob:
        first, second = (
            create_upload(alice, 3, purpose="user_data"),
            create_upload(alice, 3, purpose="user_data"),
        )
        refused = create_upload_response(alice, 3)
        error = api_error(refused, 429)
        assert error["code"] == "too_many_open_uploads"
        assert "--max-open-uploads" in error["message"] and "'alice'" in error["message"]
        assert int(refused.headers["retry-after"]) > 0
        create_upload(bob, 3)  # per tenant
        alice.post(f"/v1/uploads/{first['id']}/cancel").raise_for_status()
        third = create_upload(alice, 3, purpose="user_data")
        assert api_error(create_upload_response(alice, 3), 429)["code"] == "too_many_open_uploads"
        done = complete(alice, second["id"], [add_part(alice, second["id"], b"abc")])
        assert done.status_code == 200, done.text
        create_upload(alice, 3, purpose="user_data")
        assert third["status"] == "pending"
