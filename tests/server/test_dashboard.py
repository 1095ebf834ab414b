"""The dashboard's page and assets, and the figures it shows: a batch's pace and time left, and the
running totals in the pool status. Through HTTP on the in-process app (the browser drives the page
in test_dashboard_browser.py)."""

from __future__ import annotations

import html
import json
import re
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from html.parser import HTMLParser
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from batchgen.server.api_keys import KeyStore
from tests.conftest import in_process_app
from tests.helpers import api_error, chat_line, submit, wait_for_status
from tests.live import LiveServer

ApiFactory = Callable[..., TestClient[Litestar]]
SERVER_PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "batchgen-server"
DASHBOARD_FILES = ("page.html", "dashboard.js", "dashboard.css")
SHIPPED_FILES = (*DASHBOARD_FILES, "favicon.ico")
SLOW = ("--simulated-latency-s", "0.05", "--max-pool-size", "2")
PACE_FIELDS = ("requests_per_second", "estimated_seconds_remaining", "estimated_completion_at")
TOTAL_FIELDS = (
    "requests_completed_total",
    "requests_failed_total",
    "prompt_tokens_total",
    "completion_tokens_total",
)


class _Links(HTMLParser):
    """Every src= and href= of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [value for name, value in attrs if name in ("src", "href") and value]


def _packaged(name: str) -> bytes:
    return (files("batchgen.server") / "dashboard" / name).read_bytes()


def test_the_page_names_the_model_and_backend_and_loads_only_its_own_files(api: TestClient[Litestar]) -> None:
    response = api.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in response.headers["content-security-policy"]
    page = response.text
    model = api.get("/v1/models").json()["data"][0]["id"]
    assert f'<b id="models">{model}</b>' in page
    assert '<b id="backend">simulated</b>' in page
    parser = _Links()
    parser.feed(page)
    assert sorted(parser.links) == ["/favicon.ico", "/ui/dashboard.css", "/ui/dashboard.js"]
    for link in parser.links:  # each is served, and is the file shipped in the package
        asset = api.get(link)
        assert asset.status_code == 200
        assert asset.content == _packaged(link.rsplit("/", 1)[1])
    assert api.get("/ui/dashboard.js").headers["content-type"].startswith("text/javascript")
    assert api.get("/ui/dashboard.css").headers["content-type"].startswith("text/css")


@pytest.mark.live
def test_the_wheel_ships_the_page_and_its_assets(tmp_path: Path) -> None:
    """An installed (not editable) server has the files too: they are in the built wheel."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), str(SERVER_PACKAGE)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("batchgen_server-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in SHIPPED_FILES:
            assert archive.read(f"batchgen/server/dashboard/{name}") == _packaged(name)


def test_the_page_and_its_assets_fetch_nothing_from_elsewhere() -> None:
    """No CDN: the page works with no internet (the script talks to its own server only)."""
    for name in DASHBOARD_FILES:
        text = _packaged(name).decode()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), name
        assert not re.search(r"^\s*import\b|\bimport\(", text, re.MULTILINE), name  # no modules loaded


def test_the_favicon_is_served_without_a_key_as_an_icon_browsers_read(tmp_path: Path) -> None:
    """Browsers ask for /favicon.ico on every page load, whatever the page links: never a 404,
    with keys or without, GET or HEAD."""
    storage = tmp_path / "storage"
    with TestClient(in_process_app(storage)) as client:
        for keyed in (False, True):
            if keyed:
                store = KeyStore(storage / "metadata.sqlite3")
                store.create_key("alice")
                store.close()
                assert client.get("/v1/batches").status_code == 401
            icon = client.get("/favicon.ico")
            assert icon.status_code == 200, keyed
            assert icon.headers["content-type"] == "image/x-icon"
            assert icon.content == _packaged("favicon.ico")
            reserved, kind, count = struct.unpack("<HHH", icon.content[:6])
            assert (reserved, kind, count) == (0, 1, 1)  # an ICO file with one image
            width, height, *_, size, offset = struct.unpack("<BBBBHHII", icon.content[6:22])
            assert (width, height) == (32, 32) and offset + size == len(icon.content)
            assert icon.content[offset : offset + 8] == b"\x89PNG\r\n\x1a\n"
            assert client.head("/favicon.ico").status_code == 200


def _snapshot(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="snapshot">(.*?)</script>', page, re.DOTALL)
    assert found is not None, "the page carries its snapshot"
    loaded: dict[str, Any] = json.loads(found.group(1))
    return loaded


def _text(page: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>(.*?)</', page, re.DOTALL)
    assert found is not None, element_id
    return html.unescape(found.group(1))


def test_the_page_arrives_with_the_servers_state_in_it(api_factory: ApiFactory) -> None:
    """No "checking…" or "loading…": health, the pools and the batches are in the page itself,
    as text for the first paint and as JSON the script draws from before its first call."""
    client = api_factory()
    batch = wait_for_status(
        client, submit(client, [chat_line(f"r{i}") for i in range(3)])["id"], {"completed"}
    )
    page = client.get("/").text
    assert "checking" not in page and "loading" not in page
    snapshot = _snapshot(page)
    assert snapshot["health"] == client.get("/health").json()
    assert _text(page, "health") == "healthy"
    assert [b["id"] for b in snapshot["batches"]["data"]] == [batch["id"]]
    assert snapshot["batches"]["data"][0]["request_counts"]["completed"] == 3
    assert f'data-batch-id="{batch["id"]}"' in page and ">3/3<" in page
    pool = client.get("/v1/pool/status").json()
    assert snapshot["pool"]["requests_completed_total"] == pool["requests_completed_total"] == 3
    assert _text(page, "intake-text").endswith("requests queued")
    assert _text(page, "slots-text").startswith(
        "running on the engine: 0 · admitted, waiting for the engine: 0"
    )
    assert "exponentially weighted over 30 s" in _text(page, "tokens-note")
    # one process: no replicas to list, and the table of them stays hidden
    assert "replicas" not in pool and '<section id="replicas" hidden>' in page


def test_with_api_keys_the_page_holds_health_but_no_tenants_data(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    with TestClient(in_process_app(storage)) as client:
        secret = submit(client, [chat_line("secret-line")], metadata={"job": "secret-job"})
        store = KeyStore(storage / "metadata.sqlite3")
        _, key = store.create_key("alice")
        store.close()
        for headers in ({}, {"Authorization": f"Bearer {key}"}, {"Authorization": "Bearer bg-nonsense"}):
            response = client.get("/", headers=headers)
            assert response.status_code == 200
            page = response.text
            snapshot = _snapshot(page)
            assert snapshot["pool"] is None and snapshot["batches"] is None
            assert snapshot["health"]["status"] == "healthy" and _text(page, "health") == "healthy"
            assert secret["id"] not in page and "secret" not in page
            assert "checking" not in page and "loading" not in page
            assert "enter an API key" in _text(page, "slots-text")


def test_the_snapshot_cannot_break_out_of_its_script_element(tmp_path: Path) -> None:
    app = in_process_app(tmp_path / "storage")
    with TestClient(app) as client:
        submit(client, [chat_line("x")], metadata={"note": "</script><script>alert(1)</script>&"})
        page = client.get("/").text
    assert "</script><script>alert(1)" not in page
    assert _snapshot(page)["batches"]["data"][0]["metadata"]["note"].startswith("</script>")


def test_an_unknown_dashboard_file_is_an_openai_shaped_404(api: TestClient[Litestar]) -> None:
    for path in ("/ui/secrets.txt", "/ui/page.html"):
        assert api_error(api.get(path), 404)["code"] == "not_found"
    assert api_error(api.get("/ui/..%2Fapp.py"), 404)["message"]


def test_the_dashboard_is_not_part_of_the_api_schema(api: TestClient[Litestar]) -> None:
    paths = api.get("/schema/openapi.json").json()["paths"]
    assert "/" not in paths
    assert not [path for path in paths if path.startswith("/ui")]


def test_the_page_escapes_the_names_it_shows(tmp_path: Path) -> None:
    app = in_process_app(tmp_path / "storage", "--served-model-name", "<script>alert(1)</script>")
    with TestClient(app) as client:
        page = client.get("/").text
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def _running_pace(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    """The batch once it has run long enough (over a second) to have a pace."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        asked_at = time.time()
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").json()
        if batch["requests_per_second"] is not None and batch["status"] == "in_progress":
            batch["asked_at"] = asked_at  # when the answer was asked for, for the ETA check
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never showed a pace: {batch}")


def test_a_running_batch_shows_its_pace_and_time_left_and_a_cancelled_one_none(
    api_factory: ApiFactory,
) -> None:
    client = api_factory(*SLOW)
    batch = submit(client, [chat_line(f"r{i}") for i in range(120)])
    assert all(batch[field] is None for field in PACE_FIELDS)  # nothing measured yet
    running = _running_pace(client, batch["id"])
    counts = running["request_counts"]
    left = counts["total"] - counts["completed"] - counts["failed"]
    assert running["requests_per_second"] > 0
    if left:
        assert running["estimated_seconds_remaining"] > 0
        # the seconds are shown rounded to a tenth, so the product may be up to 0.05 s of requests over
        shown_s = running["estimated_seconds_remaining"] - 0.05
        assert shown_s * running["requests_per_second"] <= left * 1.01 + 0.5
        # the ETA is counted from when the server answered, not from now (the test may be slow)
        assert running["estimated_completion_at"] >= int(running["asked_at"])
    listed = client.get("/v1/batches").json()["data"][0]
    assert listed["id"] == batch["id"] and set(PACE_FIELDS) <= set(listed)
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert cancelled["status"] in ("cancelling", "cancelled")
    assert all(cancelled[field] is None for field in PACE_FIELDS)  # it will not run to an end
    ended = wait_for_status(client, batch["id"], {"cancelled"})
    assert all(ended[field] is None for field in PACE_FIELDS)


def test_pool_status_totals_count_every_finished_request_and_its_tokens(api_factory: ApiFactory) -> None:
    client = api_factory("--max-context-length", "50")
    before = client.get("/v1/pool/status").json()
    assert all(before[field] == 0 for field in TOTAL_FIELDS)
    lines = [chat_line(f"ok{i}") for i in range(7)] + [chat_line(f"long{i}", "word " * 200) for i in range(3)]
    first = submit(client, lines)
    second = submit(client, [chat_line(f"more{i}") for i in range(5)])
    done = [wait_for_status(client, batch["id"], {"completed"}) for batch in (first, second)]
    assert all(batch[field] is None for batch in done for field in PACE_FIELDS)  # ended: no pace
    after = client.get("/v1/pool/status").json()
    assert after["requests_completed_total"] == sum(b["request_counts"]["completed"] for b in done) == 12
    assert after["requests_failed_total"] == sum(b["request_counts"]["failed"] for b in done) == 3
    assert after["prompt_tokens_total"] == sum(b["usage"]["input_tokens"] for b in done)
    assert after["completion_tokens_total"] == sum(b["usage"]["output_tokens"] for b in done) > 0


def test_after_a_restart_the_totals_count_only_the_new_work(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    flags = ("--simulated-latency-s", "0.1", "--max-pool-size", "2")
    with TestClient(in_process_app(storage, *flags)) as client:
        batch = submit(client, [chat_line(f"r{i}") for i in range(30)])
        deadline = time.monotonic() + 30
        while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with TestClient(in_process_app(storage, *flags)) as client:
        ended = wait_for_status(client, batch["id"], {"completed"})
        totals = client.get("/v1/pool/status").json()
    resumed_from = 30 - totals["requests_completed_total"]
    assert ended["request_counts"]["completed"] == 30
    assert 6 <= resumed_from < 30  # what ran before the restart is not counted again


def test_the_openai_sdk_reads_batch_objects_with_the_pace_fields(live_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=live_server.api_url, api_key="unused")
    with httpx.Client(base_url=live_server.base_url) as http:
        batch = submit(http, [chat_line(f"r{i}") for i in range(3)])
    retrieved = client.batches.retrieve(batch["id"])
    assert retrieved.id == batch["id"]
    assert retrieved.model_extra is not None and set(PACE_FIELDS) <= set(retrieved.model_extra)
    listed = client.batches.list(limit=5)
    assert batch["id"] in [item.id for item in listed.data]


class _Silent:
    """A backend that says nothing of its engine (as the embeddings and openai backends): the
    simulated one without its ``engine_activity``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "engine_activity":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_model_that_cannot_tell_what_its_engine_runs_does_not_blank_the_others(tmp_path: Path) -> None:
    """Two models, one whose backend cannot tell (the default setup's embeddings model): the pool
    status still gives the other's figure, and the Engine card shows it, naming the silent one."""
    import anyio

    from batchgen.core import BatchService, ServiceSettings
    from batchgen.core.backends.served_models import ServedModel
    from batchgen.core.backends.simulated import SimulatedBackend
    from batchgen.server import dashboard_snapshot

    async def main() -> dict[str, Any]:
        models = [
            ServedModel(SimulatedBackend(model_name="chat")),
            ServedModel(_Silent(SimulatedBackend(model_name="embed"))),
        ]
        async with BatchService(ServiceSettings(storage_path=tmp_path), models) as service:
            return service.pool_status().to_dict()

    pool = anyio.run(main)
    assert (pool["engine_running"], pool["engine_waiting"]) == (None, None)  # no sum of all
    assert list(pool["engines"]) == [
        {"model": "chat", "running": 0, "generated_tokens": None},
        {"model": "embed", "running": None, "generated_tokens": None},
    ]
    text = dashboard_snapshot.engine_text(pool)
    assert text.startswith("running on the engine: 0 (chat: 0) · admitted: 0 · slots: ")
    assert "(embed: its backend cannot tell" in text and "cannot tell how many of them" not in text
