"""The Uploads API across real ``batchgen-server`` replicas: any replica serves any call of an upload.

Three replicas on one PostgreSQL and one blob store (a shared folder, then a real S3 server): an
upload created on one takes its parts on the two others, sent at once, completes on the third to
a normal file that a batch runs on (every custom_id once in its output, read from another
replica); two replicas completing one upload at the same moment make one file, each answering
with it or a clear 4xx (never a 500); a cancel on another replica deletes the parts and every
replica refuses more; and a tenant's ``max_stored_bytes`` (set with ``batchgen-server keys
create --metadata-url``) holds while plain files and parts arrive on two replicas at once, round
after round: the bytes recorded never pass the limit, and what is refused is a 413
``quota_exceeded``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import api_error, chat_line, jsonl
from tests.live import LiveServer
from tests.replica_fleet import Blobs, running_replicas
from tests.server.test_chunked_uploads import add_part, complete, create_upload, post_part

pytestmark = pytest.mark.live


@pytest.fixture
def three(postgres_url: str, tmp_path: Path, blobs: Blobs) -> Iterator[list[LiveServer]]:
    with running_replicas(
        tmp_path, postgres_url, blobs, ("a", "b", "c"), "--simulated-latency-s", "0.002"
    ) as servers:
        yield servers


def _clients(servers: list[LiveServer], key: str | None = None) -> list[httpx.Client]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return [httpx.Client(base_url=server.base_url, headers=headers, timeout=60) for server in servers]


def _uploaded(client: httpx.Client) -> dict[str, int]:
    files = client.get("/v1/files").json()["data"]
    return {file["id"]: file["bytes"] for file in files if file["purpose"] != "batch_output"}


def test_an_upload_created_on_one_replica_takes_parts_on_others_and_completes_on_a_third(
    three: list[LiveServer],
) -> None:
    first, second, third = _clients(three)
    lines = 1500
    data = jsonl(*(chat_line(f"u{i}", f"question {i}") for i in range(lines)))
    cuts = sorted(random.Random(7).sample(range(1, len(data)), 7))
    parts = [data[start:stop] for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    upload = create_upload(first, len(data))
    with ThreadPoolExecutor(len(parts)) as pool:  # the parts at once, to the two other replicas
        ids = list(
            pool.map(lambda i: add_part((second, third)[i % 2], upload["id"], parts[i]), range(len(parts)))
        )
    done = complete(third, upload["id"], ids)
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["status"] == "completed" and body["file"]["bytes"] == len(data)
    file_id = body["file"]["id"]
    for client in (first, second, third):
        assert client.get(f"/v1/files/{file_id}/content").content == data
    batch = second.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert batch.status_code == 200, batch.text
    deadline = time.monotonic() + 120
    while (state := first.get(f"/v1/batches/{batch.json()['id']}").json())["status"] != "completed":
        assert state["status"] in ("validating", "in_progress", "finalizing"), state
        assert time.monotonic() < deadline, state
        time.sleep(0.3)
    output = third.get(f"/v1/files/{state['output_file_id']}/content").content
    assert Counter(json.loads(line)["custom_id"] for line in output.splitlines()) == Counter(
        f"u{i}" for i in range(lines)
    )
    # completing again on another replica (an answer lost on the way) gives the same file
    assert complete(first, upload["id"], ids).json()["file"]["id"] == file_id
    assert api_error(post_part(second, upload["id"], b"more"), 400)["code"] == "upload_completed"


def test_two_replicas_completing_at_once_make_one_file_and_a_cancel_holds_on_every_replica(
    three: list[LiveServer],
) -> None:
    clients = _clients(three)
    for round_ in range(3):
        data = jsonl(*(chat_line(f"r{round_}-{i}", "z" * (i % 50)) for i in range(400)))
        upload = create_upload(clients[round_ % 3], len(data))
        half = len(data) // 2
        ids = [
            add_part(clients[0], upload["id"], data[:half]),
            add_part(clients[1], upload["id"], data[half:]),
        ]
        before = _uploaded(clients[2])
        racers = [clients[(round_ + 1) % 3], clients[(round_ + 2) % 3]]
        with ThreadPoolExecutor(2) as pool:
            answers = [
                future.result() for future in [pool.submit(complete, c, upload["id"], ids) for c in racers]
            ]
        assert all(answer.status_code in (200, 400, 409) for answer in answers), [a.text for a in answers]
        made = set(_uploaded(clients[2])) - set(before)
        assert len(made) == 1, [answer.text for answer in answers]
        assert {answer.json()["file"]["id"] for answer in answers if answer.status_code == 200} == made
        assert clients[0].get(f"/v1/files/{made.pop()}/content").content == data
    # a cancel on another replica than the parts': every replica then refuses the upload
    upload = create_upload(clients[0], 100, purpose="user_data")
    part = add_part(clients[1], upload["id"], b"x" * 40)
    cancelled = clients[2].post(f"/v1/uploads/{upload['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    for client in clients:
        assert api_error(post_part(client, upload["id"], b"y"), 400)["code"] == "upload_cancelled"
        assert api_error(complete(client, upload["id"], [part]), 400)["code"] == "upload_cancelled"
    assert clients[1].post("/v1/uploads/upload_nonexistent/cancel").status_code == 404


def _make_key(postgres_url: str, *flags: str) -> str:
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgen.server.cli",
            "keys",
            "create",
            *flags,
            "--metadata-url",
            postgres_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


def _attempt(client: httpx.Client, kind: str, upload_id: str, size: int) -> tuple[str, int, int]:
    """Store ``size`` bytes as a plain file or as a part of ``upload_id``: (kind, size, status)."""
    if kind == "file":
        answer = client.post(
            "/v1/files", files={"file": ("f.txt", b"f" * size)}, data={"purpose": "user_data"}
        )
    else:
        answer = post_part(client, upload_id, b"p" * size)
    if answer.status_code == 413:
        assert answer.json()["error"]["code"] == "quota_exceeded"
    else:
        assert answer.status_code == 200, answer.text
    return kind, size, answer.status_code


def test_max_stored_bytes_holds_for_files_and_parts_arriving_on_two_replicas_at_once(
    three: list[LiveServer], postgres_url: str
) -> None:
    limit = 4000
    key = _make_key(postgres_url, "--tenant", "alpha", "--max-stored-bytes", str(limit))
    admin = _make_key(postgres_url, "--tenant", "ops", "--admin")
    deadline = time.monotonic() + 5
    while not all(
        httpx.get(f"{s.api_url}/files", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for s in three
    ):
        assert time.monotonic() < deadline, "a replica did not see the new key"
        time.sleep(0.1)
    clients = _clients(three[:2], key)
    chooser = random.Random(11)
    for round_ in range(4):
        sizes = [chooser.randint(100, 900) for _ in range(12)]
        uploads = [create_upload(clients[i % 2], 1000, purpose="user_data")["id"] for i in range(len(sizes))]
        with ThreadPoolExecutor(len(sizes)) as pool:
            futures = [
                pool.submit(_attempt, clients[i % 2], "file" if i % 3 == 0 else "part", uploads[i], size)
                for i, size in enumerate(sizes)
            ]
            outcomes = [future.result() for future in futures]
        kept = sum(size for _, size, status in outcomes if status == 200)
        files = _uploaded(clients[0])
        assert kept == sum(files.values()) + sum(
            size for kind, size, status in outcomes if kind == "part" and status == 200
        ), outcomes
        assert kept <= limit, outcomes
        assert any(status == 413 for _, _, status in outcomes) == (sum(sizes) > limit), outcomes
        # free everything for the next round, on the other replica
        for upload_id in uploads:
            assert clients[1].post(f"/v1/uploads/{upload_id}/cancel").status_code == 200
        for file_id in files:
            assert clients[(round_ + 1) % 2].delete(f"/v1/files/{file_id}").status_code == 200
    # the admin (no limit of its own) sees alpha's files gone
    assert (
        httpx.get(f"{three[2].api_url}/files", headers={"Authorization": f"Bearer {admin}"}).json()["data"]
        == []
    )
