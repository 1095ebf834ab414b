"""``GET /v1/files/{id}/content``: the whole file, or the byte ranges a client asks for.

The real app runs in this process (Litestar's test client) over real SQLite and files.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.helpers import ApiFactory, api_error, chat_line, jsonl, submit, upload, wait_for_status


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


def test_head_answers_what_get_would_without_the_bytes(api: httpx.Client) -> None:
    data = jsonl(*[chat_line(f"h{i}") for i in range(2)])
    url = f"/v1/files/{upload(api, data)['id']}/content"
    whole = api.head(url)
    assert whole.status_code == 200 and whole.content == b""
    assert whole.headers["content-length"] == str(len(data))
    assert whole.headers["accept-ranges"] == "bytes"
    part = api.head(url, headers={"Range": "bytes=3-7"})
    assert part.status_code == 206 and part.content == b""
    assert part.headers["content-range"] == f"bytes 3-7/{len(data)}"
    assert part.headers["content-length"] == "5"
    past = api.head(url, headers={"Range": f"bytes={len(data) + 1}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(data)}"
    assert api.head("/v1/files/file-nope/content").status_code == 404


def test_an_output_file_without_lines_is_served_empty(api_factory: ApiFactory) -> None:
    """Before a batch's first line exists its output file is an empty 200 (not an error after the
    response started), for GET and HEAD, and a suffix range of it is 416."""
    client = api_factory("--simulated-latency-s", "30")
    batch = submit(client, [chat_line("slow")])
    batch = wait_for_status(client, batch["id"], {"in_progress"})
    assert batch["output_file_id"] is not None
    url = f"/v1/files/{batch['output_file_id']}/content"
    for _ in range(2):  # twice in a row: the first leaves nothing broken behind
        empty = client.get(url)
        assert (empty.status_code, empty.content, empty.headers["content-length"]) == (200, b"", "0")
    assert client.head(url).headers["content-length"] == "0"
    for header in ("bytes=-5", "bytes=0-", "bytes=-0"):
        refused = client.get(url, headers={"Range": header})
        assert refused.status_code == 416 and refused.headers["content-range"] == "bytes */0", header
    client.post(f"/v1/batches/{batch['id']}/cancel")


def test_a_zero_length_suffix_is_not_satisfiable(api: httpx.Client) -> None:
    data = jsonl(chat_line("z"))
    url = f"/v1/files/{upload(api, data)['id']}/content"
    refused = api.get(url, headers={"Range": "bytes=-0"})
    assert refused.status_code == 416 and refused.headers["content-range"] == f"bytes */{len(data)}"
    assert api_error(refused, 416)["code"] == "range_not_satisfiable"


_SIZES = (1, 2, 7, 64)


@pytest.fixture(scope="module")
def sized_files(api: httpx.Client) -> dict[int, tuple[str, bytes]]:
    """Uploaded files of each size in ``_SIZES`` (purpose user_data: any bytes), by size."""
    files = {}
    for size in _SIZES:
        data = bytes(range(65, 65 + size)) if size < 60 else b"x" * size
        files[size] = (upload(api, data, purpose="user_data")["id"], data)
    return files


_BOUND = st.one_of(st.just(""), st.integers(0, 80).map(str), st.just("9" * 40))


@settings(
    max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(size=st.sampled_from(_SIZES), first=_BOUND, last=_BOUND, method=st.sampled_from(["GET", "HEAD"]))
def test_range_answers_follow_rfc_9110(
    api: httpx.Client,
    sized_files: dict[int, tuple[str, bytes]],
    size: int,
    first: str,
    last: str,
    method: str,
) -> None:
    """Any ``bytes=first-last`` on any file size: a valid 206 whose Content-Range matches the bytes,
    a 416 with ``bytes */size`` exactly when no byte is selected, or the whole file when ignored."""
    file_id, data = sized_files[size]
    response = api.request(method, f"/v1/files/{file_id}/content", headers={"Range": f"bytes={first}-{last}"})
    body = data if method == "GET" else b""
    if not first and not last:  # "bytes=-" is malformed: ignored
        expected: tuple[int, int] | None = None
    elif not first:
        expected = (-1, -1) if int(last) == 0 else (max(size - int(last), 0), size)
    elif last and int(last) < int(first):
        expected = None
    elif int(first) >= size:
        expected = (-1, -1)
    else:
        expected = (int(first), min(int(last) + 1, size) if last else size)
    if expected is None:
        assert response.status_code == 200 and response.content == body
        assert response.headers["content-length"] == str(size)
    elif expected == (-1, -1):
        assert response.status_code == 416 and response.headers["content-range"] == f"bytes */{size}"
    else:
        start, stop = expected
        assert response.status_code == 206
        assert response.headers["content-range"] == f"bytes {start}-{stop - 1}/{size}"
        assert response.headers["content-length"] == str(stop - start)
        assert response.content == (data[start:stop] if method == "GET" else b"")
