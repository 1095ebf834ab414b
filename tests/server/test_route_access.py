"""Route-level access with API keys: every route the app registers (read from the app, so a new
route is covered the day it is added), with every method it takes, HEAD and OPTIONS included, is
either declared open or refuses a call without a valid key; another tenant's objects are 404;
a path spelt other than canonically is refused before routing; an unknown route or method says
nothing without a key; a request without a valid key is never the admin caller.

In-process requests with odd paths go through the app's ASGI interface with the scope uvicorn
builds (``path`` percent-decoded, ``raw_path`` as sent), since httpx tidies some spellings; the
live test sends the same spellings over a socket to a real ``batchgen-server``.
"""

from __future__ import annotations

import re
import socket
import sqlite3
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar import Litestar, Request, get
from litestar.exceptions import LitestarDeprecationWarning
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from batchgen.core.tenancy import EMBEDDED
from batchgen.server.api_keys import KeyStore
from batchgen.server.auth import ApiKeyRefused, is_open, provide_caller
from batchgen.server.request_paths import path_problem
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import chat_line, jsonl, upload, wait_for_status
from tests.live import start_server

#: The routes that may be open; any other open route is a mistake (this list is deliberate).
OPEN_PATHS = {"/", "/health", "/ui/{name:str}", "/favicon.ico"}
OPEN_PREFIX = "/schema"


class Keyed:
    """An in-process app with keys: alice's objects, and keys for alice, bob, an admin, a revoked one."""

    def __init__(self, client: TestClient[Litestar], keys: dict[str, str], objects: dict[str, str]) -> None:
        self.client = client
        self.keys = keys
        self.objects = objects

    @property
    def app(self) -> Litestar:
        app: Litestar = self.client.app
        return app


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    storage = tmp_path_factory.mktemp("access") / "storage"
    with TestClient(in_process_app(storage), timeout=30) as client:
        store = KeyStore(storage / "metadata.sqlite3")
        keys = {name: store.create_key(name)[1] for name in ("alice", "bob")}
        keys["admin"] = store.create_key("ops", admin=True)[1]
        revoked_id, keys["revoked"] = store.create_key("alice")
        store.revoke(revoked_id)
        store.close()
        alice = {"Authorization": f"Bearer {keys['alice']}"}
        file_id = upload(client, jsonl(chat_line("a")), headers=alice)["id"]
        made = client.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
            headers=alice,
        )
        assert made.status_code == 200, made.text
        client.headers.update(alice)
        wait_for_status(client, made.json()["id"], {"completed"})
        client.headers.pop("Authorization")
        upload_body = {"bytes": 10, "filename": "a.jsonl", "mime_type": "text/jsonl", "purpose": "batch"}
        upload_id = client.post("/v1/uploads", json=upload_body, headers=alice).json()["id"]
        objects = {"file_id": file_id, "batch_id": made.json()["id"], "upload_id": upload_id}
        yield Keyed(client, keys, objects)


def routes(app: Litestar) -> list[tuple[str, str, bool]]:
    """Every (path template, method, open) the app routes."""
    found = []
    for route in app.routes:
        assert isinstance(route, HTTPRoute), route  # a new kind of route needs a look here
        for method, (handler, _) in route.route_handler_map.items():
            found.append((route.path, str(method), is_open(handler)))
    return sorted(found)


def concrete(template: str, objects: dict[str, str]) -> str:
    """The template with alice's ids (and a dashboard file, a schema page, the served model)
    filled in."""
    values = {**objects, "name": "dashboard.js", "path": "openapi.json", "model_id": "simulated"}
    return re.sub(r"\{(\w+):\w+\}", lambda match: values[match.group(1)], template)


def raw_request(
    client: TestClient[Litestar], method: str, raw_path: bytes, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """Send one request through the app's ASGI interface with the scope uvicorn makes of it."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(raw_path.decode("ascii")),
        "raw_path": raw_path,
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver")]
        + [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "state": {},
        "extensions": {},
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    client.blocking_portal.call(client.app, scope, receive, send)
    status = next(message["status"] for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return status, body


def _assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.method, response.request.url, response.text)
    assert response.headers["www-authenticate"].startswith("Bearer")
    if response.request.method == "HEAD":
        assert response.content == b""
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"


# --- which routes are open ----------------------------------------------------------------------


def test_only_the_declared_pages_are_open(keyed: Keyed) -> None:
    open_paths = {path for path, _, is_open_ in routes(keyed.app) if is_open_}
    assert {"/", "/health", "/ui/{name:str}", "/schema/openapi.json"} <= open_paths
    assert all(path in OPEN_PATHS or path.startswith(OPEN_PREFIX) for path in open_paths), open_paths
    for path, method, is_open_ in routes(keyed.app):
        if is_open_:
            response = keyed.client.request(method, concrete(path, keyed.objects))
            assert response.status_code != 401, (method, path)


# --- every guarded route and method, without a valid key ----------------------------------------

BAD_CREDENTIALS = {
    "missing": {},
    "unknown-key": {"Authorization": "Bearer bg-000000000000-" + "0" * 64},
    "malformed-key": {"Authorization": "Bearer nonsense"},
    "basic-auth": {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
    "empty-bearer": {"Authorization": "Bearer"},
    "no-scheme": {"Authorization": "bg-000000000000-" + "0" * 64},
}


@pytest.mark.parametrize("credentials", [*BAD_CREDENTIALS, "revoked"])
def test_every_guarded_route_and_method_refuses_a_call_without_a_valid_key(
    keyed: Keyed, credentials: str
) -> None:
    headers = (
        {"Authorization": f"Bearer {keyed.keys['revoked']}"}
        if credentials == "revoked"
        else BAD_CREDENTIALS[credentials]
    )
    guarded = [(path, method) for path, method, is_open_ in routes(keyed.app) if not is_open_]
    assert {
        ("/v1/files", "GET"),
        ("/v1/files", "HEAD"),
        ("/v1/files", "OPTIONS"),
        ("/metrics", "GET"),
    } <= set(guarded)
    for path, method in guarded:
        _assert_refused(keyed.client.request(method, concrete(path, keyed.objects), headers=headers))


def test_a_valid_key_passes_the_check_on_every_guarded_route(keyed: Keyed) -> None:
    headers = {"Authorization": f"Bearer {keyed.keys['admin']}"}
    for path, method, is_open_ in routes(keyed.app):
        if not is_open_ and not (method == "DELETE" or path.endswith("/cancel")):
            response = keyed.client.request(method, concrete(path, keyed.objects), headers=headers)
            assert response.status_code not in (401, 403) and response.status_code < 500, (method, path)


def test_another_tenants_objects_are_not_found_on_every_route_that_names_one(keyed: Keyed) -> None:
    bob = {"Authorization": f"Bearer {keyed.keys['bob']}"}
    named = [
        (path, method)
        for path, method, _ in routes(keyed.app)
        if ("{file_id" in path or "{batch_id" in path) and method != "OPTIONS"
    ]
    assert len(named) >= 6
    for path, method in named:
        response = keyed.client.request(method, concrete(path, keyed.objects), headers=bob)
        assert response.status_code == 404, (method, path, response.text)
    for listing in ("/v1/files", "/v1/batches"):
        page = keyed.client.get(listing, headers=bob)
        assert page.status_code == 200 and page.json()["data"] == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/no-such-route"),
        ("GET", "/V1/FILES"),
        ("POST", "/health/x"),
        ("PUT", "/v1/files"),
        ("PATCH", "/v1/batches/batch_x"),
        ("DELETE", "/v1/batches"),
        ("GET", "/nothing"),
        ("TRACE", "/v1/files"),
    ],
)
def test_an_unknown_route_or_method_is_told_only_to_a_caller_with_a_key(
    keyed: Keyed, method: str, path: str
) -> None:
    _assert_refused(keyed.client.request(method, path))
    known = keyed.client.request(method, path, headers={"Authorization": f"Bearer {keyed.keys['alice']}"})
    assert known.status_code in (404, 405), known.text
    assert set(known.json()["error"]) == {"message", "type", "param", "code"}


def test_every_response_of_every_route_and_method_names_its_own_request(keyed: Keyed) -> None:
    """With a key, without one, and on a route or method that does not exist: each response
    carries an ``x-request-id`` of its own (``request_ids``), whatever its status."""
    admin = {"Authorization": f"Bearer {keyed.keys['admin']}"}
    answered: list[tuple[str, str, int, str | None]] = []
    for path, method, _ in routes(keyed.app):
        if method == "DELETE" or path.endswith("/cancel"):
            continue  # they would change alice's objects for the other tests
        url = concrete(path, keyed.objects)
        for headers in ({}, admin):
            response = keyed.client.request(method, url, headers=headers)
            answered.append((method, url, response.status_code, response.headers.get("x-request-id")))
    for method, url in (("GET", "/v1/nowhere"), ("PATCH", "/v1/files"), ("TRACE", "/health")):
        for headers in ({}, admin):
            response = keyed.client.request(method, url, headers=headers)
            answered.append((method, url, response.status_code, response.headers.get("x-request-id")))
    assert {status // 100 for *_, status, _ in answered} >= {2, 4}
    assert {401, 404, 405} <= {status for *_, status, _ in answered}
    missing = [(method, url, status) for method, url, status, request_id in answered if not request_id]
    assert not missing, missing
    ids = [request_id for *_, request_id in answered]
    assert len(set(ids)) == len(ids), "two responses named the same request"
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", str(each)) for each in ids)


# --- odd path spellings ---------------------------------------------------------------------------

_SPELLINGS = [
    lambda path: "/" + path,  # //v1/files
    lambda path: path.replace("/", "//", 2),
    lambda path: path.replace("/", "/%2F", 1),
    lambda path: path.replace("/", "/%2f", 1),
    lambda path: "/%2F" + path[1:],
    lambda path: path.replace("/", "/./", 1),
    lambda path: path.replace("/", "/x/../", 1),
    lambda path: path.replace("/", "/%2e/", 1),
    lambda path: path.replace("/", "/%2E%2E/", 1),
    lambda path: path.replace("/", "\\", 1),
    lambda path: path.replace("/", "/%5C", 1),
    lambda path: path.replace("/", "/%252F", 1),
    lambda path: path + "//",
    lambda path: path + "/.",
    lambda path: "{0}/%2F{2}".format(*path.rpartition("/")),  # /v1/%2Ffiles; "\\" (no "/") too
    lambda path: path.replace("/", "/\x00", 1),
]


def _spell(path: str, spellings: tuple[int, ...]) -> bytes:
    """The raw path of ``path`` spelt with each of ``spellings`` in turn (a NUL sent as ``%00``).

    Every spelling takes any text, a path with no ``/`` left in it included (``/`` spelt ``\\``,
    then another spelling): none indexes into the path, so no draw can fail inside the test."""
    for index in spellings:
        path = _SPELLINGS[index](path)
    return path.encode("latin-1").replace(b"\x00", b"%00")


def test_every_spelling_of_every_route_is_refused_by_the_path_check(keyed: Keyed) -> None:
    """Each spelling and each pair of them (in both orders) on each route's path, the shortest
    (``/``) included: the path check refuses all, and building them raises nothing."""
    pairs = [(first, second) for first in range(len(_SPELLINGS)) for second in range(len(_SPELLINGS))]
    for path in sorted({concrete(template, keyed.objects) for template, _, _ in routes(keyed.app)}):
        for spellings in [(index,) for index in range(len(_SPELLINGS))] + pairs:
            raw = _spell(path, spellings)
            assert path_problem(unquote(raw.decode("ascii")), raw) is not None, (path, spellings, raw)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_path_spelt_otherwise_never_reaches_a_route(keyed: Keyed, data: st.DataObject) -> None:
    path, method, _ = data.draw(st.sampled_from(routes(keyed.app)))
    spellings = data.draw(st.lists(st.integers(0, len(_SPELLINGS) - 1), min_size=1, max_size=3))
    who = data.draw(st.sampled_from([None, "alice", "bob", "admin", "revoked"]))
    headers = {} if who is None else {"Authorization": f"Bearer {keyed.keys[who]}"}
    raw = _spell(concrete(path, keyed.objects), tuple(spellings))  # spellings combine
    assert path_problem(unquote(raw.decode("ascii")), raw) is not None, raw
    status, body = raw_request(keyed.client, method, raw, headers)
    assert status == 404, (method, raw, status, body)


def test_canonical_paths_pass_the_path_check() -> None:
    for path in ("/", "/health", "/v1/files", "/v1/files/", "/v1/files/file-abc/content", "/ui/dashboard.js"):
        assert path_problem(path, path.encode()) is None, path
    # a client that puts the query in raw_path (Litestar's TestClient does): the query is not the path
    assert path_problem("/v1/files", b"/v1/files?after=%25%2F%2e&limit=%5C") is None


@pytest.mark.live
def test_odd_spellings_over_a_real_socket_are_refused(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    store = KeyStore(storage / "metadata.sqlite3")
    store.create_key("alice")
    store.close()
    server = start_server(storage)
    try:
        host, port = server.base_url.removeprefix("http://").split(":")
        for raw in (
            "//v1/files",
            "/%2Fv1/files",
            "/%2fv1/files",
            "/./v1/files",
            "/v1/../v1/files",
            "/x/%2e%2e/v1/files",
            "//metrics",
            "/v1//usage",
            "/v1/files%2F",
        ):
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(f"GET {raw} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            status = int(answer.split(b" ", 2)[1])
            assert status in (400, 404), (raw, answer[:300])
        assert httpx.get(server.base_url + "/v1/files", timeout=30).status_code == 401
        for path in ("/", "/health"):
            head = httpx.head(server.base_url + path, timeout=30)
            assert head.status_code == 200 and head.content == b"", (path, head.status_code)
    finally:
        server.stop()


# --- the caller -----------------------------------------------------------------------------------


def test_no_caller_recorded_is_refused_never_the_admin() -> None:
    scope: Any = {"type": "http", "method": "GET", "path": "/", "headers": [], "state": {}}
    with pytest.raises(ApiKeyRefused):
        provide_caller(Request(scope))
    scope["state"]["batchgen.caller"] = EMBEDDED
    assert provide_caller(Request(scope)) is EMBEDDED


def test_a_key_of_the_reserved_tenant_from_an_older_version_is_refused(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    with TestClient(in_process_app(storage), timeout=30) as client:
        store = KeyStore(storage / "metadata.sqlite3")
        _, key = store.create_key("legacy")
        store.close()
        with sqlite3.connect(storage / "metadata.sqlite3") as db:  # as an older version let it be made
            db.execute("UPDATE api_keys SET tenant = 'default'")
            db.execute("UPDATE api_keys_version SET version = version + 1")
        _assert_refused(client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}))


# --- HEAD -----------------------------------------------------------------------------------------


def test_head_answers_on_every_get_route(api_factory: Any) -> None:
    client = api_factory()
    file_id = upload(client, jsonl(chat_line("a")))["id"]
    objects = {"file_id": file_id, "batch_id": "batch_none"}
    app: Litestar = client.app
    gets = {path for path, method, _ in routes(app) if method == "GET"}
    heads = {path for path, method, _ in routes(app) if method == "HEAD"}
    # every GET route takes HEAD: ``/metrics`` and Litestar's own OpenAPI pages included
    ours = gets
    assert "/metrics" in ours and {"/schema", "/schema/openapi.json", "/schema/{path:str}"} <= ours
    assert ours <= heads, ours - heads
    for path in ours:
        url = concrete(path, objects)
        got, head = client.get(url), client.head(url)
        assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
        assert head.headers.get("content-type") == got.headers.get("content-type"), path
        assert head.content == b"", path
    assert client.head("/").status_code == 200 and client.head("/health").status_code == 200


# --- deprecations ---------------------------------------------------------------------------------


def test_building_the_app_warns_of_nothing_deprecated(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        in_process_app(tmp_path / "storage")


def test_a_deprecated_handler_form_fails_the_suite() -> None:
    """The pytest configuration turns Litestar's deprecations into errors."""

    @get("/{item:str}")
    async def inferred(item: str) -> str:
        return item

    with pytest.raises(LitestarDeprecationWarning):
        Litestar([inferred])


def test_a_deprecation_raised_from_our_own_code_fails_the_suite() -> None:
    """The pytest configuration turns a DeprecationWarning raised from a ``batchgen`` module into an error."""
    module: dict[str, Any] = {"__name__": "batchgen.server.an_old_form", "warnings": warnings}
    exec("def call():\n    warnings.warn('an old form', DeprecationWarning, stacklevel=1)\n", module)
    with pytest.raises(DeprecationWarning):
        module["call"]()


# --- 405 ------------------------------------------------------------------------------------------


def test_a_method_a_route_does_not_take_is_405_with_the_methods_it_takes_in_allow(keyed: Keyed) -> None:
    """Every route of the app, asked with every method it does not take: a 405 whose ``Allow`` header
    names exactly the methods the route takes (RFC 9110 §15.5.6), in the OpenAI error shape."""
    taken: dict[str, set[str]] = {}
    for path, method, _ in routes(keyed.app):
        taken.setdefault(path, set()).add(method)
    headers = {"Authorization": f"Bearer {keyed.keys['admin']}"}
    for path, methods in taken.items():
        url = concrete(path, keyed.objects)
        for method in sorted({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"} - methods):
            response = keyed.client.request(method, url, headers=headers)
            assert response.status_code == 405, (method, path, response.status_code)
            allow = {name.strip() for name in response.headers.get("allow", "").split(",") if name.strip()}
            assert allow == methods, (method, path, allow, methods)
            if method != "HEAD":
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
