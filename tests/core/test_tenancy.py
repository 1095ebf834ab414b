"""Tenants in the embedded service: ownership, isolation, per-tenant idempotency keys and limits,
usage, and the default tenant a pipeline without tenants uses.

``test_every_caller_sees_exactly_what_it_may`` lets Hypothesis pick which tenant makes which
files and batches, then checks every (caller, object) pair through every read and write call: a
caller sees an object if and only if it is an admin or the object's tenant, and a hidden object
is "not found", exactly as an id that never existed.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core import (
    BatchService,
    Caller,
    IntakeFull,
    NotFound,
    ServiceSettings,
    TenantLimits,
    load_backend,
)
from batchgen.core.errors import InvalidRequest
from batchgen.core.models import DEFAULT_TENANT
from batchgen.core.storage import SQLiteMetadataStore
from tests.examples import examples

CHAT = "/v1/chat/completions"
TENANTS = ("alpha", "beta", "gamma")


def _lines(prefix: str, count: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {"messages": [{"role": "user", "content": f"q {i}"}]},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


async def _expect_not_found(call: object) -> None:
    with pytest.raises(NotFound):
        await call  # type: ignore[misc]


@settings(
    max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(owners=st.lists(st.sampled_from(TENANTS), min_size=1, max_size=5))
def test_every_caller_sees_exactly_what_it_may(
    tmp_path_factory: pytest.TempPathFactory, owners: list[str]
) -> None:
    storage = tmp_path_factory.mktemp("tenancy")

    async def scenario() -> None:
        async with BatchService(ServiceSettings(storage_path=storage), load_backend("simulated")) as service:
            made: list[tuple[str, str, str, str]] = []  # (owner, file, batch, output)
            for number, owner in enumerate(owners):
                caller = Caller(owner)
                file = await service.create_file(_lines(f"{owner}{number}", 2), caller=caller)
                batch = await service.create_batch(file.id, CHAT, caller=caller)
                done = await service.wait_for_batch(batch.id)
                assert done.owner == owner
                made.append((owner, file.id, batch.id, done.output_file_id or ""))
            callers = [Caller(tenant) for tenant in TENANTS] + [Caller("root", admin=True)]
            for caller in callers:
                files = {f.id for f in (await service.list_files(caller=caller))[0]}
                batches = {b.id for b in (await service.list_batches(limit=100, caller=caller))[0]}
                for owner, file_id, batch_id, output_id in made:
                    visible = caller.admin or caller.tenant == owner
                    assert (file_id in files, output_id in files, batch_id in batches) == (visible,) * 3
                    if visible:
                        assert (await service.get_file(output_id, caller=caller)).owner == owner
                        assert (await service.get_batch(batch_id, caller=caller)).id == batch_id
                        continue
                    await _expect_not_found(service.get_file(file_id, caller=caller))
                    await _expect_not_found(service.file_content(output_id, caller=caller))
                    await _expect_not_found(service.get_batch(batch_id, caller=caller))
                    await _expect_not_found(service.cancel_batch(batch_id, caller=caller))
                    await _expect_not_found(service.delete_file(file_id, caller=caller))
                    with pytest.raises(InvalidRequest, match=f"No file with id '{file_id}'"):  # as unknown
                        await service.create_batch(file_id, CHAT, caller=caller)
                    with pytest.raises(InvalidRequest):  # as a cursor that never existed
                        await service.list_files(after=file_id, caller=caller)
                    with pytest.raises(InvalidRequest):
                        await service.list_batches(after=batch_id, caller=caller)
            usage = {entry.tenant: entry for entry in await service.usage()}
            for tenant in set(owners):
                assert usage[tenant].requests == 2 * owners.count(tenant)
                assert usage[tenant].batches == owners.count(tenant)

    anyio.run(scenario)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_pipeline_without_tenants_owns_everything_as_the_default_tenant(tmp_path: Path) -> None:
    async with BatchService(ServiceSettings(storage_path=tmp_path), load_backend("simulated")) as service:
        file = await service.create_file(_lines("plain", 3))
        batch = await service.wait_for_batch((await service.create_batch(file.id, CHAT)).id)
        assert (file.owner, batch.owner) == (DEFAULT_TENANT, DEFAULT_TENANT)
        assert [entry.tenant for entry in await service.usage()] == [DEFAULT_TENANT]
        assert (await service.usage())[0].requests == 3
        # a tenant that is not an admin does not see the default tenant's objects
        await _expect_not_found(service.get_batch(batch.id, caller=Caller("someone")))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_idempotency_keys_are_per_tenant(tmp_path: Path) -> None:
    async with BatchService(ServiceSettings(storage_path=tmp_path), load_backend("simulated")) as service:
        staged = {}
        for tenant in ("alpha", "beta"):
            path = service.new_upload_path()
            path.write_bytes(_lines(tenant, 1))
            staged[tenant] = await service.add_file(
                path, filename="in.jsonl", purpose="batch", idempotency_key="same", caller=Caller(tenant)
            )
        assert staged["alpha"].id != staged["beta"].id
        first = await service.create_batch(
            staged["alpha"].id, CHAT, idempotency_key="k", caller=Caller("alpha")
        )
        again = await service.create_batch(
            staged["alpha"].id, CHAT, idempotency_key="k", caller=Caller("alpha")
        )
        other = await service.create_batch(
            staged["beta"].id, CHAT, idempotency_key="k", caller=Caller("beta")
        )
        assert first.id == again.id != other.id


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_tenant_limits_refuse_with_the_tenants_own_figures(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path)
    async with BatchService(settings, load_backend("simulated", latency_s=5)) as service:
        limited = Caller("small", limits=TenantLimits(max_queued_requests=4, max_active_batches=1))
        big = await service.create_file(_lines("big", 5), caller=limited)
        with pytest.raises(InvalidRequest) as over:  # larger than the limit itself: never fits, no retry
            await service.create_batch(big.id, CHAT, caller=limited)
        assert over.value.code == "capacity_exceeded" and not hasattr(over.value, "retry_after_s")
        assert "tenant 'small'" in over.value.message and "limit of 4 queued requests" in over.value.message
        fits = await service.create_file(_lines("fits", 3), caller=limited)
        running = await service.create_batch(fits.id, CHAT, caller=limited)
        second = await service.create_file(_lines("second", 1), caller=limited)
        with pytest.raises(IntakeFull) as busy:
            await service.create_batch(second.id, CHAT, caller=limited)
        assert "max_active_batches) is 1" in busy.value.message
        # another tenant is held to nothing but the server's own limits
        unlimited = Caller("big")
        other = await service.create_file(_lines("other", 50), caller=unlimited)
        await service.create_batch(other.id, CHAT, caller=unlimited)
        await service.cancel_batch(running.id, caller=limited)


def test_a_database_from_before_tenants_is_read_as_the_default_tenants(tmp_path: Path) -> None:
    """Rows written before the owner columns existed belong to the default tenant."""
    path = tmp_path / "metadata.sqlite3"
    store = SQLiteMetadataStore(path)
    store.close()
    with sqlite3.connect(path) as db:  # what an older version's tables looked like
        db.execute("ALTER TABLE files DROP COLUMN owner")
        db.execute("DROP INDEX IF EXISTS idx_batches_owner_seq")
        db.execute("ALTER TABLE batches DROP COLUMN owner")
        db.execute(
            "INSERT INTO files (seq, id, bytes, created_at, filename, purpose, path, line_count) "
            "VALUES (1, 'file-old', 3, 0, 'a.jsonl', 'batch', '/nowhere', 1)"
        )
    store = SQLiteMetadataStore(path)
    try:
        old = store.get_file("file-old")
        assert old is not None and old.owner == DEFAULT_TENANT
        assert [
            f.id
            for f in store.list_files(
                after=None, limit=10, descending=True, purpose=None, owner=DEFAULT_TENANT
            )[0]
        ] == ["file-old"]
        assert store.list_files(after=None, limit=10, descending=True, purpose=None, owner="other")[0] == []
    finally:
        store.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_batchs_error_file_belongs_to_the_batchs_tenant(tmp_path: Path) -> None:
    settings = ServiceSettings(storage_path=tmp_path, error_file="openai", max_request_attempts=1)
    async with BatchService(settings, load_backend("simulated", failure_rate=1.0)) as service:
        owner, other = Caller("alpha"), Caller("beta")
        file = await service.create_file(_lines("failing", 2), caller=owner)
        batch = await service.wait_for_batch((await service.create_batch(file.id, CHAT, caller=owner)).id)
        assert batch.error_file_id is not None and batch.request_counts.failed == 2
        assert (await service.get_file(batch.error_file_id, caller=owner)).owner == "alpha"
        await _expect_not_found(service.get_file(batch.error_file_id, caller=other))
        await _expect_not_found(service.file_content(batch.error_file_id, caller=other))
        await _expect_not_found(service.delete_file(batch.error_file_id, caller=other))
        assert batch.error_file_id not in {f.id for f in (await service.list_files(caller=other))[0]}
