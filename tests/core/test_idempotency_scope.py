"""Idempotency-Keys are scoped alike for every tenant, the default (embedded) one too: no key of
one tenant can spell another tenant's stored key; a key with a control character is refused; a
default-tenant key stored unscoped by an older version still replays."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core import BatchService, Caller, ServiceSettings, load_backend
from batchgen.core.errors import InvalidRequest
from batchgen.core.idempotency import check_key
from batchgen.core.models import DEFAULT_TENANT
from batchgen.core.tenancy import EMBEDDED, KEY_SEPARATOR, reserved_tenant_problem, scoped_key

CHAT = "/v1/chat/completions"
_TENANTS = st.sampled_from([DEFAULT_TENANT, "alice", "bob", "a.b", "ops@x"])
_KEYS = st.text(min_size=1, max_size=12) | st.builds(
    lambda tenant, key: f"{tenant}{KEY_SEPARATOR}{key}", _TENANTS, st.text(min_size=1, max_size=6)
)


def _usable(key: str) -> bool:
    try:
        check_key(key)
    except InvalidRequest:
        return False
    return True


@given(first=st.tuples(_TENANTS, _KEYS), second=st.tuples(_TENANTS, _KEYS))
def test_no_two_callers_keys_are_stored_alike(first: tuple[str, str], second: tuple[str, str]) -> None:
    if _usable(first[1]) and _usable(second[1]) and first != second:
        assert scoped_key(*first) != scoped_key(*second)


@given(key=st.text(min_size=1, max_size=20))
def test_a_key_with_a_control_character_is_refused(key: str) -> None:
    if any(ord(char) < 0x20 or 0x7F <= ord(char) < 0xA0 for char in key):
        with pytest.raises(InvalidRequest):
            check_key(key)


@pytest.mark.parametrize("name", ["default", "Default", "DEFAULT", "a\x1fb", "tab\there"])
def test_reserved_and_separator_tenant_names_have_a_problem(name: str) -> None:
    assert reserved_tenant_problem(name) is not None
    assert reserved_tenant_problem("alice") is None


def _lines(prefix: str) -> bytes:
    line = {
        "custom_id": prefix,
        "method": "POST",
        "url": CHAT,
        "body": {"messages": [{"role": "user", "content": "q"}]},
    }
    return json.dumps(line).encode() + b"\n"


async def _add(service: BatchService, caller: Caller, key: str) -> str:
    path = service.new_upload_path()
    path.write_bytes(_lines(caller.tenant))
    file = await service.add_file(
        path, filename="in.jsonl", purpose="batch", idempotency_key=key, caller=caller
    )
    return file.id


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_default_tenant_cannot_reach_another_tenants_key(tmp_path: Path) -> None:
    async with BatchService(ServiceSettings(storage_path=tmp_path), load_backend("simulated")) as service:
        alices = await _add(service, Caller("alice"), "K1")
        with pytest.raises(InvalidRequest):
            await _add(service, EMBEDDED, f"alice{KEY_SEPARATOR}K1")
        assert await _add(service, Caller("alice"), "K1") == alices  # alice's key is untouched
        assert await _add(service, EMBEDDED, "K1") != alices


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_default_tenant_key_stored_by_an_older_version_still_replays(tmp_path: Path) -> None:
    async with BatchService(ServiceSettings(storage_path=tmp_path), load_backend("simulated")) as service:
        first = await _add(service, EMBEDDED, "old-key")
        databases = [path for path in tmp_path.rglob("*.sqlite3")]
        rewritten = 0
        for database in databases:
            with sqlite3.connect(database) as db:
                if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'idempotency_keys'").fetchone():
                    rewritten += db.execute(
                        "UPDATE idempotency_keys SET key = 'old-key' WHERE key = ?",
                        (scoped_key(DEFAULT_TENANT, "old-key"),),
                    ).rowcount
        assert rewritten == 1  # now stored as an older version stored it
        assert await _add(service, EMBEDDED, "old-key") == first
        assert await _add(service, Caller("alice"), "old-key") != first
