"""API keys shared by replicas: the same rules on SQLite and PostgreSQL, and what sharing means.

The first tests run over both stores (``KeyStore`` on a SQLite file, ``PostgresKeyStore`` on a
database of its own per test): two stores on one database stand for a running server and the
``keys`` command, or for two replicas. The rest are PostgreSQL's: a watching store (a running
replica) checks keys from memory, sees another replica's revocation within its refresh interval,
keeps answering while the key tables cannot be read, saves last uses from its own thread, and
shares a database with the metadata store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.tenancy import Caller, TenantLimits
from batchgen.server.api_keys import ApiKeys, KeyStore
from batchgen.server.postgres_api_keys import PostgresKeyStore
from tests.examples import examples
from tests.live import free_port

#: What both stores offer the server and the ``keys`` command.
Store = ApiKeys


Opener = Callable[[], Store]
REFRESH_S = 0.2


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.live)])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens stores on one database (each call another connection, as another process would)."""
    opened: list[Store] = []
    if request.param == "sqlite":

        def make() -> Store:
            opened.append(KeyStore(tmp_path / "metadata.sqlite3"))
            return opened[-1]
    else:
        url = request.getfixturevalue("postgres_url")

        def make() -> Store:
            opened.append(PostgresKeyStore(url))
            return opened[-1]

    yield make
    for store in opened:
        store.close()


def test_a_key_authenticates_its_tenant_and_is_listed_without_its_secret(open_store: Opener) -> None:
    store = open_store()
    key_id, key = store.create_key("alpha", limits=TenantLimits(max_queued_requests=9, weight=2))
    _, admin = store.create_key("ops", admin=True)
    assert store.authenticate(key) == Caller("alpha", limits=TenantLimits(max_queued_requests=9, weight=2))
    assert store.authenticate(admin) == Caller("ops", admin=True)
    secret = key.rsplit("-", 1)[1]
    records = store.list_keys()
    assert [record.id for record in records if record.tenant == "alpha"] == [key_id]
    assert all(secret not in repr(record) and secret != record.secret_sha256 for record in records)
    assert [tenant.name for tenant in store.tenants()] == ["alpha", "ops"]


@settings(
    max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    position=st.integers(3, 80), replacement=st.sampled_from("0123456789abcdef-x"), noise=st.text(max_size=90)
)
def test_a_changed_key_or_any_other_string_is_refused(
    open_store: Opener, position: int, replacement: str, noise: str
) -> None:
    store = open_store()
    try:
        _, key = store.create_key("alpha")
        changed = key[:position] + replacement + key[position + 1 :]
        if changed != key:
            assert store.authenticate(changed) is None
        assert store.authenticate(key[:-1]) is None and store.authenticate(key + "0") is None
        if noise != key:
            assert store.authenticate(noise) is None
    finally:
        store.close()


def test_a_revocation_or_new_limits_from_another_connection_are_seen_on_the_next_check(
    open_store: Opener,
) -> None:
    server, command = open_store(), open_store()
    reloads: list[dict[str, TenantLimits]] = []
    server.on_reload = reloads.append
    key_id, key = command.create_key("alpha")
    assert server.authenticate(key) == Caller("alpha")
    command.set_limits("alpha", TenantLimits(max_active_batches=2, weight=3))
    assert server.authenticate(key) == Caller("alpha", limits=TenantLimits(max_active_batches=2, weight=3))
    assert reloads[-1] == {"alpha": TenantLimits(max_active_batches=2, weight=3)}
    assert command.revoke(key_id) and not command.revoke(key_id)
    assert server.authenticate(key) is None
    assert server.has_keys(), "revoking every key does not open the server"
    with pytest.raises(KeyError):
        command.set_limits("nobody", TenantLimits())
    with pytest.raises(ValueError, match="tenant name"):
        command.create_key("no spaces")


def test_last_uses_are_saved(open_store: Opener) -> None:
    server, command = open_store(), open_store()
    key_id, key = command.create_key("alpha")
    before = int(time.time())
    assert server.authenticate(key) is not None
    assert server.save_last_use(wait=True)
    (record,) = command.list_keys()
    assert record.id == key_id and record.last_used_at is not None and record.last_used_at >= before


# --- PostgreSQL: replicas ---------------------------------------------------------------------
def _until(condition: Callable[[], bool], within_s: float) -> float:
    """Seconds until ``condition`` held (polled every 20 ms); fails after ``within_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, f"not within {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture
def replicas(postgres_url: str) -> Iterator[tuple[PostgresKeyStore, PostgresKeyStore]]:
    """A watching store (a running replica) and a plain one (the ``keys`` command on another)."""
    replica, command = (
        PostgresKeyStore(postgres_url, refresh_interval_s=REFRESH_S),
        PostgresKeyStore(postgres_url),
    )
    replica.watch()
    yield replica, command
    replica.close()
    command.close()


def test_a_replica_sees_a_revocation_made_elsewhere_within_its_refresh_interval(
    replicas: tuple[PostgresKeyStore, PostgresKeyStore],
) -> None:
    replica, command = replicas
    key_id, key = command.create_key("alpha")
    _until(lambda: replica.authenticate(key) is not None, within_s=2.0)
    command.revoke(key_id)
    assert _until(lambda: replica.authenticate(key) is None, within_s=2.0) < REFRESH_S + 1.0


def test_a_replica_checks_keys_from_memory_while_the_key_tables_cannot_be_read(
    replicas: tuple[PostgresKeyStore, PostgresKeyStore], postgres_url: str
) -> None:
    replica, command = replicas
    reload_threads: set[int] = set()
    replica.on_reload = lambda limits: reload_threads.add(threading.get_ident())
    _, key = command.create_key("alpha")
    _, other = command.create_key("beta")
    _until(lambda: replica.authenticate(other) is not None, within_s=2.0)
    with psycopg.connect(postgres_url) as holder:
        holder.execute("LOCK TABLE api_keys_version, api_keys, tenants IN ACCESS EXCLUSIVE MODE")
        slowest = 0.0
        deadline = time.monotonic() + 3 * REFRESH_S + 0.5  # the thread is stuck on the lock meanwhile
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert replica.has_keys() and replica.authenticate(key) == Caller("alpha")
            assert replica.save_last_use() is False  # noted, left to the thread: no wait here
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.01)
        holder.rollback()
    assert slowest < 0.05, f"a check took {slowest:.3f} s while the tables were locked"
    key_id = command.create_key("gamma")[0]
    command.set_limits("alpha", TenantLimits(weight=5))
    _until(lambda: replica.authenticate(key) == Caller("alpha", limits=TenantLimits(weight=5)), within_s=2.0)
    assert reload_threads == {threading.get_ident()}, "on_reload ran off the checking thread"
    assert command.revoke(key_id)


def test_a_replica_saves_last_uses_from_its_own_thread(
    replicas: tuple[PostgresKeyStore, PostgresKeyStore],
) -> None:
    replica, command = replicas
    _, key = command.create_key("alpha")
    _until(lambda: replica.authenticate(key) is not None, within_s=2.0)
    _until(lambda: command.list_keys()[0].last_used_at is not None, within_s=2.0)
    # the thread's commit is visible a moment before it marks the use saved
    _until(lambda: replica.save_last_use() is True, within_s=2.0)


def test_key_tables_share_a_database_with_the_metadata_store(postgres_url: str) -> None:
    from batchgen.core.storage.postgres_metadata import PostgresMetadataStore

    metadata = PostgresMetadataStore(postgres_url)
    stores = []
    try:
        errors: list[BaseException] = []

        def open_one() -> None:
            try:
                stores.append(PostgresKeyStore(postgres_url))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=open_one) for _ in range(3)]  # replicas starting together
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [] and len(stores) == 3
        _, key = stores[0].create_key("alpha")
        assert all(store.authenticate(key) == Caller("alpha") for store in stores)
        assert metadata.list_batches(after=None, limit=10) == ([], False)
    finally:
        for store in stores:
            store.close()
        metadata.close()


def test_an_unreachable_database_fails_the_start_without_its_password() -> None:
    url = f"postgresql://batchgen:hunter2@127.0.0.1:{free_port()}/nothing"
    with pytest.raises(ConnectionError) as raised:
        PostgresKeyStore(url)
    assert "hunter2" not in str(raised.value) and "127.0.0.1" in str(raised.value)
