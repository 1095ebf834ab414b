"""Two tenants and an admin on one live server: keys, 401s, isolation in every endpoint, revoke,
pool status and usage, through raw HTTP, the ``openai`` SDK and the project's client.

Keys are made with the real ``batchgen-server keys`` command before the server starts (and, for
revoke and limits, while it runs). Another tenant's id must answer exactly as an id that never
existed (404 for an object, the same 400 for a list cursor): never 403, never a hint.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from batchgen.client import APIStatusError, AsyncBatchGenClient, BatchGenHttpClient, RetryPolicy
from tests.helpers import chat_line, jsonl, upload, wait_for_status
from tests.keys import authorized, create_key, keys_command
from tests.live import LiveServer, start_server

pytestmark = pytest.mark.live  # a live server, and the keys command
TENANTS = ("alice", "bob")


class Tenancy:
    """The live server, each tenant's key and client, and the objects each tenant made."""

    def __init__(self, server: LiveServer, keys: dict[str, str]) -> None:
        self.server = server
        self.keys = keys
        self.clients = {name: authorized(server.base_url, key) for name, key in keys.items()}
        self.objects: dict[str, dict[str, str]] = {}

    def make_objects(self, tenant: str) -> None:
        client = self.clients[tenant]
        lines = [chat_line(f"{tenant}-{i}", f"question {i} from {tenant}") for i in range(3)]
        file_id = upload(client, jsonl(*lines))["id"]
        batch = client.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        )
        assert batch.status_code == 200, batch.text
        done = wait_for_status(client, batch.json()["id"], {"completed"})
        spare = upload(client, jsonl(chat_line(f"{tenant}-spare")))["id"]
        self.objects[tenant] = {
            "file": file_id,
            "batch": done["id"],
            "output": done["output_file_id"],
            "spare_file": spare,
        }

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


@pytest.fixture(scope="module")
def tenancy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenancy]:
    storage = tmp_path_factory.mktemp("tenants") / "storage"
    storage.mkdir()
    keys = {name: create_key(storage, name)[1] for name in TENANTS}
    keys["admin"] = create_key(storage, "ops", "--admin")[1]
    server = start_server(storage)
    setup = Tenancy(server, keys)
    try:
        for name in TENANTS:
            setup.make_objects(name)
        yield setup
    finally:
        setup.close()
        server.stop()


# --- 401 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer bg-000000000000-" + "0" * 64},
        {"Authorization": "Bearer nonsense"},
        {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
        {"Authorization": "Bearer"},
    ],
    ids=["missing", "unknown-key", "malformed-key", "basic-auth", "empty-bearer"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/files"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches/batch_x"),
        ("GET", "/v1/pool/status"),
        ("GET", "/v1/usage"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/v1/no-such-route"),
        ("DELETE", "/v1/files/file-x"),
    ],
)
def test_every_v1_call_without_a_valid_key_is_401(
    tenancy: Tenancy, headers: dict[str, str], method: str, path: str
) -> None:
    response = httpx.request(method, tenancy.server.base_url + path, headers=headers, timeout=30)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"


def test_health_and_the_dashboard_path_stay_open(tenancy: Tenancy) -> None:
    assert httpx.get(tenancy.server.base_url + "/health", timeout=30).status_code == 200
    assert httpx.get(tenancy.server.base_url + "/", timeout=30).status_code != 401


def test_the_openai_sdk_gets_an_authentication_error_with_a_wrong_key(tenancy: Tenancy) -> None:
    with (
        openai.OpenAI(base_url=tenancy.server.api_url, api_key="bg-wrong", max_retries=0) as sdk,
        pytest.raises(openai.AuthenticationError),
    ):
        sdk.files.list()


# --- isolation: every endpoint, both directions -------------------------------------------------

Call = Callable[[httpx.Client, dict[str, str]], httpx.Response]

ENDPOINTS: dict[str, Call] = {
    "retrieve file": lambda c, o: c.get(f"/v1/files/{o['file']}"),
    "file content": lambda c, o: c.get(f"/v1/files/{o['file']}/content"),
    "file content HEAD": lambda c, o: c.head(f"/v1/files/{o['file']}/content"),
    "file content Range": lambda c, o: c.get(
        f"/v1/files/{o['file']}/content", headers={"Range": "bytes=0-9"}
    ),
    "delete file": lambda c, o: c.delete(f"/v1/files/{o['spare_file']}"),
    "retrieve output file": lambda c, o: c.get(f"/v1/files/{o['output']}"),
    "output file content": lambda c, o: c.get(f"/v1/files/{o['output']}/content"),
    "delete output file": lambda c, o: c.delete(f"/v1/files/{o['output']}"),
    "retrieve batch": lambda c, o: c.get(f"/v1/batches/{o['batch']}"),
    "cancel batch": lambda c, o: c.post(f"/v1/batches/{o['batch']}/cancel"),
    "create batch on the file": lambda c, o: c.post(
        "/v1/batches", json={"input_file_id": o["file"], "endpoint": "/v1/chat/completions"}
    ),
    "list files after it": lambda c, o: c.get("/v1/files", params={"after": o["file"]}),
    "list batches after it": lambda c, o: c.get("/v1/batches", params={"after": o["batch"]}),
}
NEVER_EXISTED = {
    "file": "file-neverexisted00000000",
    "batch": "batch_neverexisted0000000",
    "output": "file-neverexisted11111111",
    "spare_file": "file-neverexisted22222222",
}


def _shape(response: httpx.Response, ids: dict[str, str]) -> tuple[int, Any]:
    """Status and error body with the ids in it blanked, to compare two answers."""
    if response.request.method == "HEAD" or not response.content:
        return response.status_code, None
    text = response.text
    for value in ids.values():
        text = text.replace(value, "<id>")
    return response.status_code, json.loads(text)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize(("owner", "intruder"), [("alice", "bob"), ("bob", "alice")])
def test_another_tenants_id_answers_as_one_that_never_existed(
    tenancy: Tenancy, endpoint: str, owner: str, intruder: str
) -> None:
    call = ENDPOINTS[endpoint]
    theirs = tenancy.objects[owner]
    client = tenancy.clients[intruder]
    answer = call(client, theirs)
    unknown = call(client, NEVER_EXISTED)
    assert answer.status_code != 403
    assert answer.status_code in (400, 404), answer.text
    assert _shape(answer, theirs) == _shape(unknown, NEVER_EXISTED)
    if "list" not in endpoint:  # a listing cursor and a create's input_file_id are bad input: 400
        assert answer.status_code == (400 if endpoint == "create batch on the file" else 404)
    # and the owner's objects are untouched
    owner_client = tenancy.clients[owner]
    for kind in ("file", "spare_file", "output"):
        assert owner_client.get(f"/v1/files/{theirs[kind]}").status_code == 200
    assert owner_client.get(f"/v1/batches/{theirs['batch']}").json()["status"] == "completed"


def test_lists_show_only_the_tenants_own_objects_on_every_page(tenancy: Tenancy) -> None:
    for tenant in TENANTS:
        with openai.OpenAI(
            base_url=tenancy.server.api_url, api_key=tenancy.keys[tenant], max_retries=0
        ) as sdk:
            files = {file.id for file in sdk.files.list(limit=1)}  # one per page: every cursor is used
            batches = {batch.id for batch in sdk.batches.list(limit=1)}
        mine = tenancy.objects[tenant]
        others = [objects for name, objects in tenancy.objects.items() if name != tenant]
        assert {mine["file"], mine["output"], mine["spare_file"]} <= files
        assert mine["batch"] in batches
        for other in others:
            assert not {other["file"], other["output"], other["spare_file"]} & files
            assert other["batch"] not in batches


def test_an_admin_key_sees_and_reads_everything(tenancy: Tenancy) -> None:
    admin = tenancy.clients["admin"]
    files = {file["id"] for file in admin.get("/v1/files").json()["data"]}
    batches = {batch["id"] for batch in admin.get("/v1/batches", params={"limit": 100}).json()["data"]}
    for objects in tenancy.objects.values():
        assert {objects["file"], objects["output"]} <= files
        assert objects["batch"] in batches
        assert admin.get(f"/v1/files/{objects['output']}/content").status_code == 200
        assert admin.get(f"/v1/batches/{objects['batch']}").status_code == 200


def test_an_admin_key_manages_another_tenants_objects(tenancy: Tenancy) -> None:
    alice, admin = tenancy.clients["alice"], tenancy.clients["admin"]
    file_id = upload(alice, jsonl(chat_line("to-delete")))["id"]
    assert admin.delete(f"/v1/files/{file_id}").status_code == 200
    assert alice.get(f"/v1/files/{file_id}").status_code == 404
    batch = admin.post(
        "/v1/batches",
        json={"input_file_id": tenancy.objects["alice"]["file"], "endpoint": "/v1/chat/completions"},
    )
    assert batch.status_code == 200, batch.text  # an admin may run a tenant's file


def test_idempotency_keys_are_per_tenant(tenancy: Tenancy) -> None:
    """The same Idempotency-Key from two tenants makes two objects (no 409, no replay of the other's)."""
    key = {"Idempotency-Key": f"shared-key-{time.monotonic_ns()}"}
    made = {}
    for tenant in TENANTS:
        content = jsonl(chat_line(f"{tenant}-idem", f"only {tenant}"))
        first = upload(tenancy.clients[tenant], content, headers=key)
        again = upload(tenancy.clients[tenant], content, headers=key)
        assert again["id"] == first["id"]
        made[tenant] = first["id"]
    assert made["alice"] != made["bob"]
    batches = {}
    key = {"Idempotency-Key": f"shared-batch-key-{time.monotonic_ns()}"}
    for tenant in TENANTS:
        body = {"input_file_id": made[tenant], "endpoint": "/v1/chat/completions"}
        response = tenancy.clients[tenant].post("/v1/batches", json=body, headers=key)
        assert response.status_code == 200, response.text
        batches[tenant] = response.json()["id"]
        assert (
            tenancy.clients[tenant].post("/v1/batches", json=body, headers=key).json()["id"]
            == batches[tenant]
        )
    assert batches["alice"] != batches["bob"]
    for tenant in TENANTS:
        wait_for_status(tenancy.clients[tenant], batches[tenant], {"completed"})


# --- the project's client ---------------------------------------------------------------------


def test_the_project_client_sends_its_key_and_sees_only_its_tenant(
    tenancy: Tenancy, caplog: pytest.LogCaptureFixture
) -> None:
    policy = RetryPolicy(max_retries=2)
    with BatchGenHttpClient(tenancy.server.base_url, api_key=tenancy.keys["alice"], retry=policy) as client:
        assert client.get_batch(tenancy.objects["alice"]["batch"])["status"] == "completed"
        with pytest.raises(APIStatusError) as refused:
            client.get_batch(tenancy.objects["bob"]["batch"])
        assert refused.value.status_code == 404
    caplog.set_level("DEBUG", logger="batchgen.client")
    with BatchGenHttpClient(tenancy.server.base_url, retry=policy) as anonymous:
        with pytest.raises(APIStatusError) as unauthorized:
            anonymous.list_batches()
        assert unauthorized.value.status_code == 401
        assert unauthorized.value.code == "invalid_api_key"
    messages = [record.getMessage() for record in caplog.records]
    assert sum("-> HTTP 401" in message for message in messages) == 1, messages  # sent once
    assert not [message for message in messages if "retry" in message.lower()]  # a 401 is not retried


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_async_client_sends_its_key(tenancy: Tenancy) -> None:
    async with AsyncBatchGenClient(tenancy.server.base_url, api_key=tenancy.keys["bob"]) as client:
        batch = await client.get_batch(tenancy.objects["bob"]["batch"])
        assert batch["status"] == "completed"
        with pytest.raises(APIStatusError) as refused:
            await client.get_file(tenancy.objects["alice"]["file"])
        assert refused.value.status_code == 404
    async with AsyncBatchGenClient(tenancy.server.base_url, api_key="bg-wrong") as wrong:
        with pytest.raises(APIStatusError) as unauthorized:
            await wrong.pool_status()
        assert unauthorized.value.status_code == 401


# --- revoke, list, secrets ----------------------------------------------------------------------


def test_a_revoked_key_stops_working_at_once_on_the_running_server(tenancy: Tenancy) -> None:
    storage = tenancy.server.storage_path
    key_id, key = create_key(storage, "carol")
    with authorized(tenancy.server.base_url, key) as carol:
        assert carol.get("/v1/files").status_code == 200  # a key made while the server runs works
        keys_command(storage, "revoke", key_id)
        response = carol.get("/v1/files")
        assert response.status_code == 401, response.text
    assert keys_command(storage, "revoke", key_id, check=False).returncode != 0  # already revoked


def test_keys_list_shows_ids_and_use_but_never_a_secret(tenancy: Tenancy) -> None:
    listing = keys_command(tenancy.server.storage_path, "list").stdout
    for tenant, key in tenancy.keys.items():
        key_id, secret = key.split("-")[1:]
        assert key_id in listing
        assert secret not in listing
        assert (tenant if tenant != "admin" else "ops") in listing
    database = (tenancy.server.storage_path / "metadata.sqlite3").read_bytes()
    wal = tenancy.server.storage_path / "metadata.sqlite3-wal"
    stored = database + (wal.read_bytes() if wal.exists() else b"")
    log = tenancy.server.log_path.read_text()
    for key in tenancy.keys.values():
        assert key.split("-")[2].encode() not in stored  # hashed, never stored
        assert key not in log


# --- pool status and usage ----------------------------------------------------------------------


def test_pool_status_shows_other_tenants_only_to_an_admin(tenancy: Tenancy) -> None:
    alice = tenancy.clients["alice"].get("/v1/pool/status").json()
    assert [entry["tenant"] for entry in alice["tenants"]] == ["alice"]
    assert "scheduling_pool_capacity" in alice
    admin = tenancy.clients["admin"].get("/v1/pool/status").json()
    assert isinstance(admin["tenants"], list)


def test_usage_is_per_tenant_and_admins_see_every_tenant(tenancy: Tenancy) -> None:
    own = tenancy.clients["alice"].get("/v1/usage").json()["data"]
    assert [entry["tenant"] for entry in own] == ["alice"]
    alice_batches = tenancy.clients["alice"].get("/v1/batches", params={"limit": 100}).json()["data"]
    assert own[0]["requests"] == sum(
        b["request_counts"]["completed"] + b["request_counts"]["failed"] for b in alice_batches
    )
    assert own[0]["prompt_tokens"] == sum(b["usage"]["input_tokens"] for b in alice_batches) > 0
    assert own[0]["completion_tokens"] == sum(b["usage"]["output_tokens"] for b in alice_batches) > 0
    everyone = {entry["tenant"] for entry in tenancy.clients["admin"].get("/v1/usage").json()["data"]}
    assert {"alice", "bob"} <= everyone


# --- per-tenant limits --------------------------------------------------------------------------


def test_a_tenant_over_its_own_limits_is_refused_naming_them(tenancy: Tenancy) -> None:
    """A batch larger than the tenant's own limit can never fit: 400, no Retry-After (a 429 would be
    retried for ever); a limit the batch fits is 429 only while the tenant's other work drains."""
    storage = tenancy.server.storage_path
    _, key = create_key(storage, "dave", "--max-queued-requests", "5", "--max-active-batches", "3")
    with authorized(tenancy.server.base_url, key) as dave:
        big = upload(dave, jsonl(*[chat_line(f"d-{i}") for i in range(6)]))["id"]
        response = dave.post("/v1/batches", json={"input_file_id": big, "endpoint": "/v1/chat/completions"})
        assert response.status_code == 400, response.text
        assert "retry-after" not in response.headers
        error = response.json()["error"]
        assert error["code"] == "capacity_exceeded"
        message = error["message"]
        assert "dave" in message and "max_queued_requests" in message and "(6 requests)" in message
        assert "5 queued requests" in message and "never fit" in message and "Retry later" not in message
        assert "batchgen-server keys set-limits --tenant dave" in message
        keys_command(storage, "set-limits", "--tenant", "dave", "--max-queued-requests", "100")
        accepted = dave.post("/v1/batches", json={"input_file_id": big, "endpoint": "/v1/chat/completions"})
        assert accepted.status_code == 200, accepted.text  # changed on the running server
        wait_for_status(dave, accepted.json()["id"], {"completed"})
        keys_command(storage, "set-limits", "--tenant", "dave", "--max-active-batches", "0")
        refused = dave.post("/v1/batches", json={"input_file_id": big, "endpoint": "/v1/chat/completions"})
        assert refused.status_code == 400 and "retry-after" not in refused.headers
        assert "max_active_batches is 0" in refused.json()["error"]["message"]
    # the other tenants have no limits beyond the server's
    alice = tenancy.clients["alice"]
    many = upload(alice, jsonl(*[chat_line(f"a-{i}") for i in range(50)]))["id"]
    ok = alice.post("/v1/batches", json={"input_file_id": many, "endpoint": "/v1/chat/completions"})
    assert ok.status_code == 200, ok.text
    wait_for_status(alice, ok.json()["id"], {"completed"})
