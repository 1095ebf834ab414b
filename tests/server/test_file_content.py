"""``GET /v1/files/{id}/content``: the whole file, or the byte ranges a client asks for.

The real app runs in this process (Litestar's test client) over real SQLite and files.
"""

from __future__ import annotations

import httpx

from tests.helpers import chat_line, jsonl, upload


def test_content_serves_byte_ranges(api: httpx.Client) -> None:
    data = jsonl(*[chat_line(f"r{i}") for i in range(3)])
    url = f"/v1/files/{upload(api, data)['id']}/content"
    whole = api.get(url)
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["accept-ranges"] == "bytes"
    tail = api.get(url, headers={"Range": "bytes=10-"})
    assert tail.status_code == 206 and tail.content == data[10:]
    assert tail.headers["content-range"] == f"bytes 10-{len(data) - 1}/{len(data)}"
    middle = api.get(url, headers={"Range": "bytes=5-9"})
    assert (middle.status_code, middle.content) == (206, data[5:10])
    suffix = api.get(url, headers={"Range": "bytes=-4"})
    assert (suffix.status_code, suffix.content) == (206, data[-4:])
    past = api.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(data)}"
    assert past.json()["error"]["code"] == "range_not_satisfiable"
