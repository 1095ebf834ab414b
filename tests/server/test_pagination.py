"""``after`` / ``order`` paging of ``GET /v1/files`` and ``GET /v1/batches`` through the API.

A cursor naming a file deleted since pages on; a cursor naming nothing is a 400, as is an
``order`` other than ``asc`` or ``desc``. (Paging under random deletes is fuzzed against the
store in ``tests/core/test_storage_contract.py``.)
"""

from __future__ import annotations

import httpx

from tests.helpers import ApiFactory, api_error, chat_line, jsonl, submit, upload


def test_a_cursor_naming_a_deleted_file_pages_on(api_factory: ApiFactory) -> None:
    client = api_factory()
    ids = [upload(client, jsonl(chat_line(f"p{i}")))["id"] for i in range(5)]
    first = client.get("/v1/files", params={"limit": 2, "order": "asc"}).json()
    assert [f["id"] for f in first["data"]] == ids[:2] and first["has_more"]
    assert client.delete(f"/v1/files/{first['last_id']}").status_code == 200
    rest = client.get("/v1/files", params={"limit": 10, "order": "asc", "after": first["last_id"]}).json()
    assert [f["id"] for f in rest["data"]] == ids[2:] and not rest["has_more"]


def test_unknown_cursors_are_400(api: httpx.Client) -> None:
    for path in ("/v1/files", "/v1/batches"):
        error = api_error(api.get(path, params={"after": "nothing-like-this"}), 400)
        assert error["param"] == "after"


def test_batches_list_in_either_order_and_refuse_others(api_factory: ApiFactory) -> None:
    client = api_factory()
    ids = [submit(client, [chat_line(f"b{i}")])["id"] for i in range(3)]
    newest = client.get("/v1/batches").json()["data"]
    assert [b["id"] for b in newest] == ids[::-1]
    oldest = client.get("/v1/batches", params={"order": "asc", "limit": 2}).json()
    assert [b["id"] for b in oldest["data"]] == ids[:2] and oldest["has_more"]
    rest = client.get("/v1/batches", params={"order": "asc", "after": oldest["last_id"]}).json()
    assert [b["id"] for b in rest["data"]] == ids[2:] and not rest["has_more"]
    assert api_error(client.get("/v1/batches", params={"order": "sideways"}), 400)["param"] == "order"
