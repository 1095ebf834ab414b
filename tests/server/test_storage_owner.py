"""One owner per storage folder: a second server or embedded service on a folder in use is refused.

The live tests run real ``batchgen-server`` processes (and a fresh Python embedding the service) on
127.0.0.1 over one folder; the in-process ones start two ``BatchService``s in this process. The
lock is the kernel's, so a killed owner (``SIGKILL``) leaves nothing that blocks the next start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest

from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.service import BatchService, ServiceSettings
from batchgen.core.storage.folder_lock import (
    LOCK_FILE_NAME,
    FolderLock,
    StorageFolderInUse,
    folder_holder,
)
from tests.helpers import TERMINAL, chat_line, create_batch, file_lines, upload, wait_for_status, write_jsonl
from tests.live import LiveServer, free_port

#: The exit status of a start refused by the command (a usage-level refusal, as argparse's).
EXIT_REFUSED = 2


def _second_server(storage: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run ``batchgen-server`` on ``storage`` until it exits (it must, being refused)."""
    command = [sys.executable, "-m", "batchgen.server.cli", "--backend", "simulated"]
    command += ["--port", str(free_port()), "--storage-path", str(storage), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def _assert_refused_naming(result: subprocess.CompletedProcess[str], holder_pid: int, storage: Path) -> None:
    assert result.returncode == EXIT_REFUSED, result.stderr
    message = result.stderr
    assert f"process {holder_pid}" in message and socket.gethostname() in message
    assert str(storage) in message and "--storage-path" in message and "in use" in message
    assert "Traceback" not in message


def test_a_second_server_on_the_folder_refuses_and_the_batch_runs_once(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """The issue's symptom: a second server resumed the first one's running batch, and the output
    had 704 lines for 400 requests. Now the second refuses, whenever it is started."""
    first = server_factory("--simulated-latency-s", "0.02", "--max-pool-size", "8")
    holder = json.loads((first.storage_path / LOCK_FILE_NAME).read_text())
    assert holder["pid"] == first.process.pid and holder["host"] == socket.gethostname()
    assert "--storage-path" in holder["command"] and holder["started_at"]
    total = 400
    with httpx.Client(base_url=first.base_url, timeout=30) as client:
        input_file = upload(
            client, write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}") for i in range(total)])
        )
        batch = create_batch(client, input_file["id"])
        wait_for_status(client, batch["id"], {"in_progress"})
        for flags in [(), ("--max-pool-size", "64")]:  # refused while the batch runs, with any flags
            _assert_refused_naming(
                _second_server(first.storage_path, *flags), first.process.pid, first.storage_path
            )
        assert client.get("/health").status_code == 200, "the refused start disturbed the owner"
        ended = wait_for_status(client, batch["id"], TERMINAL, timeout_s=120)
        lines = file_lines(client, ended["output_file_id"])
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)) == total, "a request ran twice"
    assert ended["status"] == "completed" and ended["request_counts"]["completed"] == total


def test_a_killed_owner_leaves_no_stale_lock(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    first = server_factory("--simulated-latency-s", "30")
    with httpx.Client(base_url=first.base_url, timeout=30) as client:
        input_file = upload(
            client, write_jsonl(tmp_path / "in.jsonl", [chat_line(f"k{i}") for i in range(5)])
        )
        batch_id = create_batch(client, input_file["id"])["id"]
        wait_for_status(client, batch_id, {"in_progress"})
    assert folder_holder(first.storage_path) is not None
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=30)
    assert folder_holder(first.storage_path) is None, "the kernel released the dead owner's lock"
    second = server_factory("--simulated-latency-s", "0.01")  # same folder: starts, resumes the batch
    with httpx.Client(base_url=second.base_url, timeout=30) as client:
        ended = wait_for_status(client, batch_id, TERMINAL, timeout_s=60)
    assert ended["status"] == "completed" and ended["request_counts"]["completed"] == 5
    assert json.loads((second.storage_path / LOCK_FILE_NAME).read_text())["pid"] == second.process.pid


_EMBED = """
import sys, anyio
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.service import BatchService, ServiceSettings
from batchgen.core.storage.folder_lock import StorageFolderInUse

async def main():
    try:
        async with BatchService(ServiceSettings(storage_path=sys.argv[1]), SimulatedBackend()):
            print("started")
    except StorageFolderInUse as exc:
        print(exc)
        sys.exit(7)

anyio.run(main)
"""


def test_an_embedded_service_in_another_process_is_refused_beside_a_server(
    server_factory: Callable[..., LiveServer],
) -> None:
    server = server_factory()
    embedded = subprocess.run(
        [sys.executable, "-c", _EMBED, str(server.storage_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert embedded.returncode == 7, embedded.stdout + embedded.stderr
    assert f"process {server.process.pid}" in embedded.stdout
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    server.stop()
    again = subprocess.run(
        [sys.executable, "-c", _EMBED, str(server.storage_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 0 and "started" in again.stdout, again.stdout + again.stderr


def _keys(storage: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "batchgen.server.cli",
        "keys",
        *arguments,
        "--storage-path",
        str(storage),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_keys_commands_work_beside_a_running_server(server_factory: Callable[..., LiveServer]) -> None:
    server = server_factory()
    created = _keys(server.storage_path, "create", "--tenant", "alice")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    listed = _keys(server.storage_path, "list")
    assert listed.returncode == 0 and "alice" in listed.stdout, listed.stderr
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        deadline = time.monotonic() + 10
        while client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code != 200:
            assert time.monotonic() < deadline, "the server never accepted the key made beside it"
            time.sleep(0.1)
    limits = _keys(server.storage_path, "set-limits", "--tenant", "alice", "--weight", "2")
    assert limits.returncode == 0, limits.stderr
    key_id = next(
        line.split()[0] for line in _keys(server.storage_path, "list").stdout.splitlines() if "alice" in line
    )
    revoked = _keys(server.storage_path, "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    assert server.process.poll() is None
    assert json.loads((server.storage_path / LOCK_FILE_NAME).read_text())["pid"] == server.process.pid


def _service(storage: Path) -> BatchService:
    return BatchService(ServiceSettings(storage_path=storage), SimulatedBackend())


def test_a_second_embedded_service_in_this_process_is_refused(tmp_path: Path) -> None:
    storage = tmp_path / "storage"

    async def scenario() -> None:
        async with _service(storage):
            for _ in range(2):  # the refusal leaves the owner's lock as it was
                with pytest.raises(StorageFolderInUse) as refused:
                    async with _service(storage):
                        pass
                assert refused.value.holder.pid == os.getpid() and refused.value.folder == storage
                assert "in use" in refused.value.message and "(this process)" in refused.value.message
            assert folder_holder(storage) is not None
        assert folder_holder(storage) is None, "a stopped service gives the folder up"
        async with _service(storage):  # the next owner starts
            pass

    anyio.run(scenario)


def test_a_refused_service_touches_nothing_in_the_folder(tmp_path: Path) -> None:
    """The owner's upload in progress (a staging file) survives a second service's refused start."""
    storage = tmp_path / "storage"

    async def scenario() -> None:
        async with _service(storage) as owner:
            staging = owner.new_upload_path()
            staging.write_bytes(b"half an upload")
            with pytest.raises(StorageFolderInUse):
                async with _service(storage):
                    pass
            assert staging.read_bytes() == b"half an upload"

    anyio.run(scenario)


def test_the_lock_is_per_open_file_and_says_who_holds_it(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "folder"  # made on demand
    with FolderLock(folder) as lock:
        assert lock.held
        holder = folder_holder(folder)
        assert holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname()
        with pytest.raises(StorageFolderInUse):
            FolderLock(folder).acquire()
    assert not lock.held and folder_holder(folder) is None
    assert (folder / LOCK_FILE_NAME).exists(), "the file stays for the next owner (no unlink race)"
    (folder / LOCK_FILE_NAME).write_text("not json")  # what a stale or foreign file may hold
    with FolderLock(folder):
        assert folder_holder(folder) is not None


def test_the_server_app_in_process_refuses_a_folder_in_use(tmp_path: Path) -> None:
    from litestar.testing import TestClient

    from tests.conftest import in_process_app

    storage = tmp_path / "storage"
    with TestClient(in_process_app(storage), timeout=30) as first:
        assert first.get("/health").status_code == 200
        with pytest.raises(BaseException) as refused, TestClient(in_process_app(storage), timeout=30):
            pass
        assert _contains(refused.value, StorageFolderInUse), refused.value
        assert first.get("/health").status_code == 200


def _contains(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``error`` is ``kind`` or holds one (the test client wraps the lifespan's error in a group)."""
    if isinstance(error, kind):
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(_contains(inner, kind) for inner in error.exceptions)
    return error.__cause__ is not None and _contains(error.__cause__, kind)


def test_the_same_folder_by_another_name_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock is on the file itself, so a symbolic link or a relative path reaches the same owner."""
    storage = tmp_path / "storage"
    (tmp_path / "alias").symlink_to(storage, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    with FolderLock(storage):
        for other_name in (tmp_path / "alias", Path("storage"), Path("alias/../storage")):
            with pytest.raises(StorageFolderInUse):
                FolderLock(other_name).acquire()


_RACE = """
import sys
from batchgen.core.storage.folder_lock import FolderLock
from batchgen.server import cli

lock = FolderLock(sys.argv[1])
lock.acquire()  # the other owner (another open file: the service's own lock is refused)
cli.folder_holder = lambda folder, real=cli.folder_holder, calls=[]: calls.append(1) or (
    None if len(calls) == 1 else real(folder)
)  # the check before the start saw the folder free: the owner came just after it
cli.main(["--backend", "simulated", "--port", sys.argv[2], "--storage-path", sys.argv[1]])
"""


@pytest.mark.live
def test_a_server_that_loses_the_race_for_the_folder_refuses_the_same_way(tmp_path: Path) -> None:
    """The check before the start can pass while another owner takes the folder: the service's own
    lock then refuses, and the command still says so in one paragraph with status 2."""
    storage = tmp_path / "storage"
    result = subprocess.run(
        [sys.executable, "-c", _RACE, str(storage), str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == EXIT_REFUSED, result.stdout + result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("batchgen-server: error: refusing to start")
    assert "--storage-path" in result.stderr and "(this process)" in result.stderr
