"""The Uploads API against real server processes: the unchanged ``openai`` SDK's
``upload_file_chunked`` (sync and async) and a batch over the file it made; ``expires_after``
of ``uploads.create``, after which the file made is deleted; ``kill -9`` while
parts arrive and while an upload completes (after a restart no half-made file is listed or
served, and the upload completes, once); a full disk under the uploads, which fails only the
part that hit it; parts sent one after another stored without a copy, and parts arriving at once
still completing to the bytes named.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.helpers import (
    TERMINAL,
    api_error,
    chat_line,
    create_batch,
    file_lines,
    jsonl,
    wait_for_status,
    write_jsonl,
)
from tests.live import LiveServer
from tests.server.test_chunked_uploads import add_part, complete, create_upload, file_ids, post_part


def _sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def test_the_openai_sdks_chunked_upload_makes_a_file_a_batch_runs_on(
    live_server: LiveServer, tmp_path: Path
) -> None:
    lines = [chat_line(f"sdk-{i}", f"question {i} " * (i % 9)) for i in range(200)]
    path = write_jsonl(tmp_path / "big.jsonl", lines)
    with _sdk(live_server) as sdk:
        # parts of 997 bytes: lines cut across parts everywhere
        upload = sdk.uploads.upload_file_chunked(
            file=path, mime_type="text/jsonl", purpose="batch", part_size=997
        )
        assert upload.status == "completed" and upload.file is not None
        assert upload.bytes == upload.file.bytes == path.stat().st_size
        assert upload.filename == "big.jsonl" and upload.file.filename == "big.jsonl"
        assert sdk.files.content(upload.file.id).content == path.read_bytes()
        batch = sdk.batches.create(
            input_file_id=upload.file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with httpx.Client(base_url=live_server.base_url, timeout=30) as client:
        done = wait_for_status(client, batch.id, TERMINAL, timeout_s=120)
        assert done["status"] == "completed"
        output = file_lines(client, done["output_file_id"])
    assert sorted(line["custom_id"] for line in output) == sorted(f"sdk-{i}" for i in range(200))


def test_the_sdks_expires_after_makes_the_uploads_file_expire(live_server: LiveServer) -> None:
    """``uploads.create(expires_after=...)``: the file the upload makes expires that long after it
    is made, and the server deletes it then."""
    data = jsonl(*[chat_line(f"exp-{i}") for i in range(20)])
    with _sdk(live_server) as sdk:
        upload = sdk.uploads.create(
            bytes=len(data),
            filename="short-lived.jsonl",
            mime_type="text/jsonl",
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 1},
        )
        part = sdk.uploads.parts.create(upload_id=upload.id, data=data)
        done = sdk.uploads.complete(upload_id=upload.id, part_ids=[part.id])
        assert done.status == "completed" and done.file is not None
        assert done.file.expires_at == done.file.created_at + 1
        deadline = time.monotonic() + 60
        while True:  # the maintenance job deletes it once it expired
            try:
                sdk.files.retrieve(done.file.id)
            except openai.NotFoundError:
                break
            assert time.monotonic() < deadline, "the upload's file was not deleted when it expired"
            time.sleep(0.2)
        with pytest.raises(openai.BadRequestError, match="between 1 and"):
            sdk.uploads.create(
                bytes=len(data),
                filename="a.jsonl",
                mime_type="text/jsonl",
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 0},
            )


def test_the_async_sdks_chunked_upload_with_an_md5(live_server: LiveServer, tmp_path: Path) -> None:
    data = jsonl(*[chat_line(f"async-{i}") for i in range(50)])
    path = tmp_path / "async.jsonl"
    path.write_bytes(data)

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=live_server.api_url, api_key="unused", max_retries=0) as sdk:
            upload = await sdk.uploads.upload_file_chunked(
                file=path,
                mime_type="text/jsonl",
                purpose="batch",
                part_size=1500,
                md5=hashlib.md5(data).hexdigest(),
            )
            wrong = None
            try:
                await sdk.uploads.upload_file_chunked(
                    file=data,
                    filename="x.jsonl",
                    bytes=len(data),
                    mime_type="text/jsonl",
                    purpose="batch",
                    part_size=1500,
                    md5="0" * 32,
                )
            except openai.BadRequestError as exc:
                wrong = exc
            return upload, wrong

    upload, wrong = anyio.run(run)
    assert upload.status == "completed" and upload.file.bytes == len(data)
    assert wrong is not None and wrong.code == "md5_mismatch"


def _files_with_inode(root: Path, inode: int) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and path.stat().st_ino == inode]


def test_parts_sent_one_after_another_become_the_file_without_a_copy(
    server_factory: Callable[..., LiveServer],
) -> None:
    """The parts are written once: into the upload's log as they arrive, and the log, renamed,
    is the stored file (the same inode), with the bytes of the parts in order."""
    data = jsonl(*[chat_line(f"once-{i}", "z" * 200) for i in range(3000)])
    pieces = [data[i : i + 150_000] for i in range(0, len(data), 150_000)]
    server = server_factory()
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        upload = create_upload(client, len(data))
        ids = [add_part(client, upload["id"], piece) for piece in pieces]
        log = server.storage_path / "uploads" / upload["id"] / "arrived.log"
        inode = log.stat().st_ino
        done = complete(client, upload["id"], ids)
        assert done.status_code == 200, done.text
        stored = _files_with_inode(server.storage_path, inode)
        assert len(stored) == 1 and stored[0].read_bytes() == data
        assert client.get(f"/v1/files/{done.json()['file']['id']}/content").content == data


def test_parts_arriving_at_once_complete_to_the_bytes_of_the_order_named(
    server_factory: Callable[..., LiveServer],
) -> None:
    """One part arrives slowly into the log while the others arrive beside it (into files of
    their own); completed in their file order, the upload is exactly those bytes."""
    data = jsonl(*[chat_line(f"once-{i}", "w" * 200) for i in range(2000)])
    pieces = [data[i : i + 100_000] for i in range(0, len(data), 100_000)]
    server = server_factory()
    slow_id: list[str] = []

    def slow_body() -> Iterator[bytes]:
        boundary = "sl0w"
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="data"; filename="x"\r\n\r\n'.encode()
        yield pieces[0][:50_000]
        time.sleep(1.5)  # the other parts arrive meanwhile
        yield pieces[0][50_000:] + f"\r\n--{boundary}--\r\n".encode()

    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        upload = create_upload(client, len(data))

        def send_slowly() -> None:
            with httpx.Client(base_url=server.base_url, timeout=30) as sender:
                answer = sender.post(
                    f"/v1/uploads/{upload['id']}/parts",
                    content=slow_body(),
                    headers={"Content-Type": "multipart/form-data; boundary=sl0w"},
                )
                assert answer.status_code == 200, answer.text
                slow_id.append(answer.json()["id"])

        slow = threading.Thread(target=send_slowly)
        slow.start()
        time.sleep(0.3)
        others = [add_part(client, upload["id"], piece) for piece in pieces[1:]]
        folder = server.storage_path / "uploads" / upload["id"]
        assert len(list(folder.glob("*.part"))) == len(others), "the others arrived beside the log"
        slow.join(timeout=30)
        done = complete(client, upload["id"], [*slow_id, *others])
        assert done.status_code == 200, done.text
        assert client.get(f"/v1/files/{done.json()['file']['id']}/content").content == data


def _kill(server: LiveServer) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=30)


def _served_files_are_whole(client: httpx.Client, expected: set[bytes]) -> list[str]:
    """Every file listed, and its content is one of ``expected``; their ids."""
    listed = sorted(file_ids(client))
    for file_id in listed:
        assert client.get(f"/v1/files/{file_id}/content").content in expected, "a half-made file is served"
    return listed


def test_kill_9_while_parts_arrive_loses_only_the_part_in_flight(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    data = jsonl(*[chat_line(f"k-{i}", "y" * 300) for i in range(2000)])
    pieces = [data[i : i + 200_000] for i in range(0, len(data), 200_000)]
    server = server_factory(storage="kill")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        upload = create_upload(client, len(data))
        ids = [add_part(client, upload["id"], piece) for piece in pieces[:-1]]

    def slow_body() -> Iterator[bytes]:
        boundary = "b0undary"
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="data"; filename="x"\r\n\r\n'.encode()
        yield pieces[-1][:100_000]  # past the server's write buffer
        time.sleep(30)  # the server dies before the rest
        yield pieces[-1][100_000:] + f"\r\n--{boundary}--\r\n".encode()

    def send() -> None:
        with (
            httpx.Client(base_url=server.base_url, timeout=60) as sender,
            contextlib.suppress(httpx.HTTPError),
        ):
            sender.post(
                f"/v1/uploads/{upload['id']}/parts",
                content=slow_body(),
                headers={"Content-Type": "multipart/form-data; boundary=b0undary"},
            )

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    log = server.storage_path / "uploads" / upload["id"] / "arrived.log"
    whole = len(data) - len(pieces[-1])  # the parts received whole, one after another in the log
    deadline = time.monotonic() + 20
    while log.stat().st_size <= whole:
        assert time.monotonic() < deadline, "the part in flight never arrived"
        time.sleep(0.02)
    _kill(server)
    server = server_factory(storage="kill")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        assert log.stat().st_size == whole, "a half-received part is left after a restart"
        assert file_ids(client) == set()
        # the parts received whole are still there: the part in flight is sent again and the upload completes
        ids.append(add_part(client, upload["id"], pieces[-1]))
        done = complete(client, upload["id"], ids)
        assert done.status_code == 200, done.text
        assert client.get(f"/v1/files/{done.json()['file']['id']}/content").content == data


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def test_kill_9_with_a_validation_worker_running_leaves_no_process_and_the_upload_completes(
    server_factory: Callable[..., LiveServer],
) -> None:
    # 70 MB: past WORKER_MIN_BYTES, so a worker process validates the parts as they arrive
    data = jsonl(*[chat_line(f"v-{i}", "w" * 900) for i in range(70_000)])
    half = len(data) // 2
    server = server_factory(storage="worker")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        upload = create_upload(client, len(data))
        first = add_part(client, upload["id"], data[:half])
        workers = _children(server.process.pid)
        assert workers, "no validation worker was started"
    _kill(server)
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers):
        assert time.monotonic() < deadline, "the validation worker outlived the server"
        time.sleep(0.05)
    server = server_factory(storage="worker")
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        second = add_part(client, upload["id"], data[half:])
        done = complete(client, upload["id"], [first, second])
        assert done.status_code == 200, done.text
        assert done.json()["file"]["bytes"] == len(data)
        assert client.get(f"/v1/files/{done.json()['file']['id']}/content").content == data


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.mark.parametrize("moment", ["random", "assembling"])
def test_kill_9_while_an_upload_completes_never_serves_a_half_made_file(
    server_factory: Callable[..., LiveServer], moment: str
) -> None:
    rng = random.Random(22)
    data = jsonl(*[chat_line(f"c-{i}", "z" * 400) for i in range(60_000)])  # about 30 MB
    part_size = 3_000_001
    pieces = [data[i : i + part_size] for i in range(0, len(data), part_size)]
    server = server_factory(storage="complete")
    for attempt in range(2):
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            upload = create_upload(client, len(data))
            if moment == "assembling":  # sent last part first: completing copies the parts
                ids = [add_part(client, upload["id"], piece) for piece in pieces[::-1]][::-1]
            else:  # sent in order: completing renames the log
                ids = [add_part(client, upload["id"], piece) for piece in pieces]
            before = file_ids(client)
        record = server.storage_path / "uploads" / upload["id"] / "upload.json"

        def finish(
            base_url: str = server.base_url, upload_id: str = upload["id"], part_ids: list[str] = ids
        ) -> None:
            with httpx.Client(base_url=base_url, timeout=60) as sender, contextlib.suppress(httpx.HTTPError):
                complete(sender, upload_id, part_ids)

        threading.Thread(target=finish, daemon=True).start()
        if moment == "random":
            time.sleep(rng.uniform(0.0, 0.8))
        else:
            deadline = time.monotonic() + 30
            while json.loads(record.read_text())["status"] not in ("completing", "completed"):
                assert time.monotonic() < deadline, "the upload never started assembling"
                time.sleep(0.002)
        _kill(server)
        server = server_factory(storage="complete")
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            after = _served_files_are_whole(client, {data})
            status = json.loads(record.read_text())["status"]
            assert status in ("pending", "completed"), status  # a started assembly was finished at start
            if status == "pending":
                assert set(after) == before
            again = complete(client, upload["id"], ids)
            assert again.status_code == 200, again.text
            file_id = again.json()["file"]["id"]
            assert client.get(f"/v1/files/{file_id}/content").content == data
            assert set(_served_files_are_whole(client, {data})) == before | {file_id}, f"attempt {attempt}"
            assert not [path for path in record.parent.iterdir() if path.name != "upload.json"]


@pytest.fixture
def small_uploads_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted where the server keeps uploads' parts."""
    uploads = tmp_path / "disk" / "uploads"
    uploads.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(uploads)], check=True)
    try:
        yield tmp_path / "disk"
    finally:
        subprocess.run(["umount", "-l", str(uploads)], check=False)


def test_a_full_disk_fails_only_the_part_that_hit_it(
    server_factory: Callable[..., LiveServer], small_uploads_disk: Path
) -> None:
    server = server_factory(storage="disk")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        running = create_batch(
            client,
            client.post(
                "/v1/files",
                files={"file": ("a.jsonl", jsonl(*[chat_line(f"b{i}") for i in range(300)]))},
                data={"purpose": "batch"},
            ).json()["id"],
        )
        big = create_upload(client, 3_000_000)
        first = add_part(client, big["id"], b"x" * 600_000)
        error = api_error(post_part(client, big["id"], b"x" * 600_000), 507)
        assert error["code"] == "insufficient_storage"
        folder = small_uploads_disk / "uploads" / big["id"]
        assert sorted(path.name for path in folder.iterdir()) == [
            "arrived.index",
            "arrived.log",
            "upload.json",
        ]
        assert (folder / "arrived.log").stat().st_size == 600_000, "the part that hit the full disk is kept"
        assert [json.loads(line)["id"] for line in (folder / "arrived.index").read_text().splitlines()] == [
            first
        ]
        # another upload that fits goes through, and so does the batch
        data = jsonl(*[chat_line(f"s{i}") for i in range(100)])
        small = create_upload(client, len(data))
        done = complete(client, small["id"], [add_part(client, small["id"], data)])
        assert done.status_code == 200, done.text
        assert wait_for_status(client, running["id"], TERMINAL)["status"] == "completed"
        assert client.get("/health").json() == {"status": "healthy"}
        assert client.post(f"/v1/uploads/{big['id']}/cancel").json()["status"] == "cancelled"
