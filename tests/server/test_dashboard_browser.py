"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a live server.

The simulated backend takes a quarter of a second per request on four slots, so a batch's
progress, the throughput plots and a cancel can be watched as they happen. Playwright cannot
download its own browsers here: it launches the system's ``chromium`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:  # imported when a test runs: `nox -s unit` (no playwright) only collects these
    from playwright.sync_api import Browser, Page, Route

from tests.helpers import chat_line, submit, wait_for_status
from tests.keys import authorized, create_key
from tests.live import LiveServer

pytestmark = [pytest.mark.live, pytest.mark.browser]

FLAGS = ("--simulated-latency-s", "0.25", "--max-pool-size", "4")
WAIT_MS = 60_000


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "no chromium on PATH: install Debian's package (apt-get install chromium), as .ci/run does"
        )
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=_chromium(), headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1360, "height": 1000})
    opened = context.new_page()
    opened.set_default_timeout(WAIT_MS)
    yield opened
    context.close()


def _bar_count(page: Page, batch_id: str, field: str = "completed") -> int:
    value = page.get_attribute(f'tr[data-batch-id="{batch_id}"] .bar', f"data-{field}")
    return int(value or 0)


def _wait_for_bar_beyond(page: Page, batch_id: str, count: int) -> None:
    page.wait_for_function(
        """([id, count]) => {
            const bar = document.querySelector(`tr[data-batch-id="${id}"] .bar`);
            return bar !== null && Number(bar.dataset.completed) > count;
        }""",
        arg=[batch_id, count],
    )


def test_the_dashboard_follows_a_batch_plots_throughput_and_cancels_another(
    server_factory: Callable[..., LiveServer], page: Page, tmp_path: Path
) -> None:
    server = server_factory(*FLAGS)
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        watched = submit(api, [chat_line(f"watched-{i}") for i in range(160)], metadata={"job": "nightly"})
        doomed = submit(api, [chat_line(f"doomed-{i}") for i in range(400)])

        page.goto(server.base_url + "/")
        page.wait_for_selector(f'tr[data-batch-id="{watched["id"]}"]')
        assert page.text_content("#backend") == "simulated"
        page.wait_for_selector('#health[data-state="healthy"]')
        # newest first
        rows = page.eval_on_selector_all("#batch-rows tr", "rows => rows.map(r => r.dataset.batchId)")
        assert rows.index(doomed["id"]) < rows.index(watched["id"])

        # the progress bar moves, and its filled part grows with it
        _wait_for_bar_beyond(page, watched["id"], 0)
        first = _bar_count(page, watched["id"])
        first_width = _done_width(page, watched["id"])
        _wait_for_bar_beyond(page, watched["id"], first + 8)
        assert _done_width(page, watched["id"]) > first_width
        assert _bar_count(page, watched["id"], "total") == 160

        # the throughput plots get points, and their drawing changes as time goes on
        page.wait_for_function("() => Number(document.getElementById('tokens-plot').dataset.peak) > 0")
        page.wait_for_function("() => Number(document.getElementById('requests-plot').dataset.points) >= 2")
        drawn = page.eval_on_selector("#tokens-plot", "canvas => canvas.toDataURL()")
        page.wait_for_function(
            "drawn => document.getElementById('tokens-plot').toDataURL() !== drawn", arg=drawn
        )
        assert float(page.text_content("#requests-rate") or "0") > 0

        # the watched batch's details: its fields and its latest result lines (a Range read)
        page.click(f'tr[data-batch-id="{watched["id"]}"]')
        page.wait_for_function(
            "id => document.getElementById('detail-id').textContent === id", arg=watched["id"]
        )
        page.wait_for_function(
            "() => document.getElementById('detail-results').textContent.includes('watched-')"
        )
        assert '"nightly"' in (page.text_content("#detail-fields") or "")
        rate_cell = page.text_content(f'tr[data-batch-id="{watched["id"]}"] td:nth-child(4)') or ""
        page.screenshot(path=str(tmp_path / "dashboard-running.png"), full_page=True)

        # cancel the other batch from its detail panel
        page.click(f'tr[data-batch-id="{doomed["id"]}"]')
        page.wait_for_function(
            "id => document.getElementById('detail-id').textContent === id", arg=doomed["id"]
        )
        page.wait_for_selector("#cancel-batch", state="visible")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#cancel-batch")
        page.wait_for_selector(f'tr[data-batch-id="{doomed["id"]}"][data-status="cancelled"]')
        assert wait_for_status(api, doomed["id"], {"cancelled"})["status"] == "cancelled"
        page.wait_for_selector("#cancel-batch", state="hidden")  # nothing left to cancel

        # the watched batch runs on to the end, and the table says so
        page.wait_for_selector(f'tr[data-batch-id="{watched["id"]}"][data-status="completed"]')
        assert _bar_count(page, watched["id"]) == 160
        assert api.get(f"/v1/batches/{watched['id']}").json()["status"] == "completed"

    assert rate_cell.endswith("/s")
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def _done_width(page: Page, batch_id: str) -> float:
    width = page.eval_on_selector(
        f'tr[data-batch-id="{batch_id}"] .bar .done', "span => span.getBoundingClientRect().width"
    )
    return float(width)


def test_the_page_asks_for_an_api_key_and_sends_it_on_every_call(live_server: LiveServer, page: Page) -> None:
    """A server that answers 401 without ``Authorization: Bearer sk-right`` (the API's answer when
    keys are configured, played here by intercepting the page's calls)."""
    seen: list[dict[str, Any]] = []

    def guard(route: Route) -> None:
        authorization = route.request.headers.get("authorization")
        seen.append({"url": route.request.url, "authorization": authorization})
        if authorization != "Bearer sk-right":
            error = {"message": "Missing or invalid API key.", "type": "invalid_request_error", "param": None,
                     "code": "invalid_api_key"}  # fmt: skip
            route.fulfill(status=401, json={"error": error})
        else:
            route.continue_()

    with httpx.Client(base_url=live_server.base_url) as api:
        batch = submit(api, [chat_line("keyed")])
    page.route("**/v1/**", guard)
    page.goto(live_server.base_url + "/")  # the page itself needs no key
    page.wait_for_selector("#key-prompt[open]")
    assert page.locator("#batch-rows tr[data-batch-id]").count() == 0

    page.fill("#key-input", "sk-wrong")
    page.click("#key-submit")
    page.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused')")
    page.wait_for_selector("#key-prompt[open]")

    page.fill("#key-input", "sk-right")
    page.click("#key-submit")
    page.wait_for_selector(f'tr[data-batch-id="{batch["id"]}"]')
    assert page.evaluate("sessionStorage.getItem('batchgen.apiKey')") == "sk-right"
    assert not page.is_visible("#key-prompt")

    # a reload in the same tab keeps the key: no prompt, every call carries it
    seen.clear()
    page.reload()
    page.wait_for_selector(f'tr[data-batch-id="{batch["id"]}"]')
    page.wait_for_function("() => Number(document.getElementById('requests-plot').dataset.points) >= 1")
    assert not page.is_visible("#key-prompt")
    assert seen and all(call["authorization"] == "Bearer sk-right" for call in seen)
    assert {"/v1/pool/status", "/v1/batches"} <= {call["url"].split("?")[0].removeprefix(live_server.base_url)
                                                   for call in seen}  # fmt: skip


def test_the_page_works_with_a_server_that_has_real_api_keys(
    tmp_path: Path, server_factory: Callable[..., LiveServer], page: Page
) -> None:
    """Against a server with keys made by ``batchgen-server keys create``: the page itself opens
    without a key, asks for one, refuses a wrong one, and with a tenant's key shows that tenant's
    batch and not another tenant's."""
    storage = tmp_path / "keyed"
    storage.mkdir()
    _, own_key = create_key(storage, "alice")
    _, other_key = create_key(storage, "bob")
    server = server_factory(storage="keyed")
    with authorized(server.base_url, own_key) as alice, authorized(server.base_url, other_key) as bob:
        own = submit(alice, [chat_line("alice-line")])
        other = submit(bob, [chat_line("bob-line")])
    page.goto(server.base_url + "/")
    page.wait_for_selector("#key-prompt[open]")
    page.fill("#key-input", "bg-000000000000-" + "0" * 64)
    page.click("#key-submit")
    page.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused')")
    page.fill("#key-input", own_key)
    page.click("#key-submit")
    page.wait_for_selector(f'tr[data-batch-id="{own["id"]}"]')
    assert not page.is_visible("#key-prompt")
    assert page.locator(f'tr[data-batch-id="{other["id"]}"]').count() == 0


def test_the_batch_table_pages_newest_first(server_factory: Callable[..., LiveServer], page: Page) -> None:
    server = server_factory()
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        created = [submit(api, [chat_line(f"p{i}")])["id"] for i in range(23)]
    newest_first = created[::-1]

    def shown() -> list[str]:
        ids: list[str] = page.eval_on_selector_all(
            "#batch-rows tr", "rows => rows.map(r => r.dataset.batchId)"
        )
        return ids

    page.goto(server.base_url + "/")
    page.wait_for_function("() => document.querySelectorAll('#batch-rows tr[data-batch-id]').length === 20")
    assert shown() == newest_first[:20]
    assert page.is_disabled("#newer") and page.is_enabled("#older")

    page.click("#older")
    page.wait_for_function("() => document.getElementById('page-label').textContent === 'page 2'")
    page.wait_for_function("() => document.querySelectorAll('#batch-rows tr[data-batch-id]').length === 3")
    assert shown() == newest_first[20:]
    assert page.is_disabled("#older") and page.is_enabled("#newer")

    page.click("#newer")
    page.wait_for_function("() => document.getElementById('page-label').textContent === 'page 1'")
    page.wait_for_function("() => document.querySelectorAll('#batch-rows tr[data-batch-id]').length === 20")
    assert shown() == newest_first[:20]
