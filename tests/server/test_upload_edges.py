"""Uploads at the edges: a body cut short before its closing boundary, a byte-order mark, and
``Idempotency-Key`` values that are empty, too long, or name a file deleted since.

The real app runs in this process (Litestar's test client) over real SQLite and files.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.helpers import ApiFactory, api_error, chat_line, jsonl, post_file, upload

BOUNDARY = "edge-boundary-1234"


def multipart(content: bytes, purpose: str = "batch", *, closed: bool = True) -> bytes:
    """A multipart/form-data body with a ``purpose`` field and a ``file`` part, its closing
    boundary left off when ``closed`` is false."""
    body = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + content
    return body + (f"\r\n--{BOUNDARY}--\r\n".encode() if closed else b"")


def post_raw(client: httpx.Client, body: bytes) -> httpx.Response:
    return client.post(
        "/v1/files", content=body, headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    )


def stored(storage: Path) -> list[str]:
    """Every file the server keeps under its storage folder, uploads and staging alike."""
    return sorted(path.name for folder in ("files", "staging") for path in (storage / folder).iterdir())


def test_an_upload_cut_short_is_refused_and_leaves_nothing(api_factory: ApiFactory, tmp_path: Path) -> None:
    client = api_factory()
    data = jsonl(*[chat_line(f"r{i}") for i in range(20)])
    whole = post_raw(client, multipart(data))
    assert whole.status_code == 200 and whole.json()["bytes"] == len(data)
    before = (stored(tmp_path / "storage"), client.get("/v1/files").json()["data"])
    for cut in (multipart(data, closed=False), multipart(data)[:-30], multipart(data)[: len(data) // 2]):
        error = api_error(post_raw(client, cut), 400)
        assert "cut short" in error["message"] and error["param"] == "file"
    assert (stored(tmp_path / "storage"), client.get("/v1/files").json()["data"]) == before


def test_a_byte_order_mark_at_the_start_is_dropped(api: httpx.Client) -> None:
    data = jsonl(chat_line("bom-1"), chat_line("bom-2"))
    file = upload(api, b"\xef\xbb\xbf" + data)
    assert file["bytes"] == len(data)
    assert api.get(f"/v1/files/{file['id']}/content").content == data
    tiny = upload(api, b"\xef\xbb", purpose="user_data")  # shorter than a BOM: kept as it is
    assert tiny["bytes"] == 2
    inside = post_file(api, data + b"\xef\xbb\xbf" + jsonl(chat_line("bom-3")))
    assert api_error(inside, 400)["message"]  # only a leading BOM is dropped


def test_idempotency_keys_must_be_1_to_255_characters(api: httpx.Client) -> None:
    data = jsonl(chat_line("key"))
    for key in ("", "k" * 256):
        error = api_error(post_file(api, data, headers={"Idempotency-Key": key}), 400)
        assert error["param"] == "Idempotency-Key"
        file_id = upload(api, data)["id"]
        refused = api.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
            headers={"Idempotency-Key": key},
        )
        assert api_error(refused, 400)["param"] == "Idempotency-Key"
    longest = {"Idempotency-Key": "k" * 255}
    assert upload(api, data, headers=longest)["id"] == upload(api, data, headers=longest)["id"]


def test_a_retried_upload_whose_first_file_was_deleted_makes_a_new_file(api: httpx.Client) -> None:
    data = jsonl(chat_line("again"))
    headers = {"Idempotency-Key": "retry-after-delete"}
    first = upload(api, data, headers=headers)
    assert api.delete(f"/v1/files/{first['id']}").status_code == 200
    second = upload(api, data, headers=headers)
    assert second["id"] != first["id"]
    assert api.get(f"/v1/files/{second['id']}").status_code == 200
    assert upload(api, data, headers=headers)["id"] == second["id"]  # and the key now names it
