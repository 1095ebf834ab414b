"""The SQLite key store and the server's use of it: keys hashed at rest (no secret in any of its
files), last uses saved without waiting for a lock, no writing connection of the server's own, and
the 401 guard of the in-process app. The rules both key stores share (constant-time checks,
revocation and limits seen by another connection) are in ``test_key_store_contract.py``."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from batchgen.core.tenancy import Caller, TenantLimits
from batchgen.server import api_keys
from batchgen.server.api_keys import KeyStore, check_tenant_name
from batchgen.server.cli import build_parser as server_parser
from batchgen.server.keys_cli import build_parser as keys_parser
from tests.conftest import in_process_app
from tests.database_lock import locked_elsewhere


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(tmp_path / "metadata.sqlite3")


def test_a_key_is_stored_hashed_and_authenticates_its_tenant(store: KeyStore, tmp_path: Path) -> None:
    key_id, key = store.create_key("alpha", limits=TenantLimits(max_queued_requests=9, weight=2))
    assert key.startswith("bg-") and key_id in key
    assert store.authenticate(key) == Caller("alpha", limits=TenantLimits(max_queued_requests=9, weight=2))
    secret = key.rsplit("-", 1)[1]
    for path in tmp_path.iterdir():
        assert secret.encode() not in path.read_bytes()
    assert all(record.id == key_id and record.tenant == "alpha" for record in store.list_keys())


def test_the_servers_last_use_save_never_waits_for_a_lock_and_keeps_what_it_could_not_save(
    store: KeyStore, tmp_path: Path
) -> None:
    """The server saves last-use times on its event loop: a database another connection holds
    locked is not waited for (the save gives up at once, keeping the times), and the next save
    after the lock is gone writes them."""
    made = [store.create_key(tenant) for tenant in ("alpha", "beta")]
    key_ids = [key_id for key_id, _ in made]
    assert all(store.authenticate(key) is not None for _, key in made)
    with locked_elsewhere(tmp_path / "metadata.sqlite3"):
        started = time.monotonic()
        assert store.save_last_use() is False
        assert time.monotonic() - started < 1.0, "the save waited for the lock"
    saved = {
        row[0]: row[1]
        for row in sqlite3.connect(tmp_path / "metadata.sqlite3").execute(
            "SELECT id, last_used_at FROM api_keys"
        )
    }
    assert all(saved[key_id] is None for key_id in key_ids), "nothing could be saved under the lock"
    assert store.save_last_use() is True
    assert all(record.last_used_at is not None for record in store.list_keys())


def test_the_server_writes_the_database_through_no_second_connection_of_its_own(tmp_path: Path) -> None:
    """A second writing connection in the server (a last-use writer thread, say) can hold the write
    lock while the store writes, and then an upload is a 503 on a busy machine: the server saves
    last use through its maintenance, with no thread of its own."""
    storage = tmp_path / "storage"
    _, key = KeyStore(storage / "metadata.sqlite3").create_key("alpha")
    before = {thread.name for thread in threading.enumerate()}
    with TestClient(app=in_process_app(storage)) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        assert client.get("/v1/files").status_code == 200
        started = {thread.name for thread in threading.enumerate()} - before
    assert not any("key" in name for name in started), started
    [record] = KeyStore(storage / "metadata.sqlite3").list_keys()
    assert record.last_used_at is not None, "the server saved the key's last use before it stopped"


def test_last_use_is_written_at_most_once_a_minute(store: KeyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    _, key = store.create_key("alpha")
    clock = [1_000_000.0]
    monkeypatch.setattr(api_keys.time, "time", lambda: clock[0])
    store.authenticate(key)
    assert store.list_keys()[0].last_used_at == 1_000_000
    clock[0] += 30
    store.authenticate(key)
    assert store.list_keys()[0].last_used_at == 1_000_000
    clock[0] += 31
    store.authenticate(key)
    assert store.list_keys()[0].last_used_at == 1_000_061


@pytest.mark.parametrize("name", ["", "has space", "-leading", "x" * 65, "semi;colon"])
def test_bad_tenant_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        check_tenant_name(name)


def test_the_in_process_app_needs_a_key_once_one_exists(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    with TestClient(in_process_app(storage), timeout=30) as client:
        assert client.get("/v1/files").status_code == 200  # no key yet: today's behaviour
        command = KeyStore(storage / "metadata.sqlite3")
        key_id, key = command.create_key("alpha")
        refused = client.get("/v1/files")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        assert client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert client.get("/health").status_code == 200
        command.revoke(key_id)
        # with every key revoked the server refuses everyone; it does not fall open
        assert client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code == 401
        assert client.get("/v1/files").status_code == 401
        command.close()


def test_help_of_the_keys_command_and_of_the_server_names_every_subcommand() -> None:
    keys_help = keys_parser().format_help()
    for command in ("create", "list", "revoke", "set-limits"):
        assert command in keys_help
    server_help = server_parser(specs=[]).format_help()
    assert "batchgen-server keys" in server_help
    for flag in ("--allow-unauthenticated", "--ssl-certfile", "--ssl-keyfile"):
        assert flag in server_help


@pytest.mark.parametrize("name", ["default", "Default", "DEFAULT"])
@pytest.mark.parametrize("command", ["create", "set-limits"])
def test_the_reserved_tenant_name_is_refused_by_the_keys_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, command: str
) -> None:
    from batchgen.server.keys_cli import main

    with pytest.raises(SystemExit) as refused:
        main([command, "--tenant", name, "--storage-path", str(tmp_path)])
    assert refused.value.code == 2
    assert "reserved" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reserved"):
        check_tenant_name(name)
    store = KeyStore(tmp_path / "metadata.sqlite3")
    try:
        with pytest.raises(ValueError, match="reserved"):
            store.create_key(name)
        assert store.list_keys() == []
    finally:
        store.close()
