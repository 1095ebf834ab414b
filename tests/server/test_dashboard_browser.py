"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a live server.

The simulated backend takes a quarter of a second per request on four slots, so a batch's
progress, the throughput plots and a cancel can be watched as they happen. Playwright cannot
download its own browsers here: it launches the system's ``chromium`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import shutil
import time
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
    # (this server has no keys, so its page arrives with its batches drawn; a server with keys
    # sends none: test_with_api_keys_the_first_paint_holds_health_and_asks_for_a_key)

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


def test_a_refusal_answered_after_another_key_was_entered_asks_for_nothing(
    live_server: LiveServer, page: Page
) -> None:
    """The calls sent with a wrong key whose 401s come back only after the right key was entered
    (a server slow to refuse) are sent again with the right key: the prompt does not open again
    and the page goes on polling (a batch submitted afterwards appears). The server's refusals
    are played by intercepting the page's calls; all but the first wrong-key call are held until
    the right key is in."""
    wrong = "Bearer sk-wrong"
    held: list[Route] = []
    refused: list[str] = []

    def refuse(route: Route) -> None:
        error = {"message": "Missing or invalid API key.", "type": "invalid_request_error", "param": None,
                 "code": "invalid_api_key"}  # fmt: skip
        route.fulfill(status=401, json={"error": error})

    def guard(route: Route) -> None:
        authorization = route.request.headers.get("authorization")
        if authorization == "Bearer sk-right":
            route.continue_()
        elif authorization == wrong and refused:
            held.append(route)
        else:
            if authorization == wrong:
                refused.append(route.request.url)
            refuse(route)

    page.route("**/v1/**", guard)
    page.goto(live_server.base_url + "/")
    page.wait_for_selector("#key-prompt[open]")
    page.fill("#key-input", "sk-wrong")
    page.click("#key-submit")
    page.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused')")
    # the calls that waited for a key went out together with it: the pool's and the table's
    deadline = time.monotonic() + WAIT_MS / 1000
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(50)
    assert held, "every call that carried the wrong key was answered before the right key was in"

    page.fill("#key-input", "sk-right")
    page.click("#key-submit")
    page.wait_for_selector("#key-prompt:not([open])", state="attached")
    for route in held:
        refuse(route)
    with httpx.Client(base_url=live_server.base_url) as api:
        later = submit(api, [chat_line("after-the-key")])
    page.wait_for_selector(f'tr[data-batch-id="{later["id"]}"]')
    assert not page.is_visible("#key-prompt")
    assert page.evaluate("sessionStorage.getItem('batchgen.apiKey')") == "sk-right"


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


def test_a_finished_batch_s_row_is_left_in_place_by_the_polls_so_a_click_is_never_lost(
    live_server: LiveServer, page: Page
) -> None:
    """A poll that redrew a row between the press and the release of a click swallowed the click
    (seen under load): rows whose batch did not change are the same nodes poll after poll."""
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        batch = submit(api, [chat_line("still")])
        wait_for_status(api, batch["id"], {"completed"})
    row = f'tr[data-batch-id="{batch["id"]}"]'
    page.goto(live_server.base_url + "/")
    page.wait_for_selector(row + '[data-status="completed"]')
    page.eval_on_selector(row, "row => { row.marked = true; }")
    for _ in range(3):  # three polls that each read the batch list again
        before = page.inner_text("#updated")
        page.wait_for_function(
            "before => document.getElementById('updated').textContent !== before", arg=before
        )
    assert page.eval_on_selector(row, "row => row.marked === true")
    page.click(row)
    page.wait_for_function("id => document.getElementById('detail-id').textContent === id", arg=batch["id"])


# --- the layout at phone and desktop widths, results, the icon, the first paint ---------------------

WIDTHS = (360, 420, 1280)


def _png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, from its IHDR chunk."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def _layout(page: Page) -> dict[str, Any]:
    """What decides whether the page fits its width: the page's scroll width, the header band's
    box, and each batch row's (or card's) box against the batch card's."""
    layout: dict[str, Any] = page.evaluate(
        """() => {
            const box = (node) => { const r = node.getBoundingClientRect(); return [r.left, r.right]; };
            const card = document.getElementById('batches');
            const inside = (node) => {
                const [left, right] = box(node), [cardLeft, cardRight] = box(card);
                return left >= cardLeft - 0.5 && right <= cardRight + 0.5;
            };
            const header = document.querySelector('header');
            const cells = [...document.querySelectorAll('#batch-rows tr, #batch-rows td, #detail .result')];
            return {
                viewport: window.innerWidth,
                scrollWidth: document.scrollingElement.scrollWidth,
                header: box(header),
                outside: cells.filter((node) => !inside(node)).map((node) => node.outerHTML.slice(0, 120)),
                cards: [...document.querySelectorAll('main > section, .card, .plots figure')]
                    .filter((node) => box(node)[1] > window.innerWidth + 0.5).map((node) => node.id || node.className),
                rows: document.querySelectorAll('#batch-rows tr[data-batch-id]').length,
                // content that spills out of its own box (text that does not wrap)
                spills: [...document.querySelectorAll('main *')]
                    .filter((node) => node.clientWidth > 0 && node.scrollWidth > node.clientWidth + 1
                            && getComputedStyle(node).overflowX === 'visible')
                    .map((node) => `${node.tagName}.${node.className} ${node.scrollWidth}>${node.clientWidth}`),
            };
        }"""
    )
    return layout


def test_the_page_fits_phone_and_desktop_widths_without_sideways_scrolling(
    server_factory: Callable[..., LiveServer], browser: Browser, tmp_path: Path
) -> None:
    """At 360 and 420 px (phones) and 1280 px: the page never scrolls sideways, the header band
    spans the width, the batch rows (cards on a phone) and result lines stay inside their card,
    and a full-page screenshot is exactly as wide as the screen."""
    server = server_factory(*FLAGS)
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        long_id = "a-rather-long-custom-id-" + "x" * 60
        done = submit(api, [chat_line(long_id), chat_line("short")], metadata={"job": "y" * 120})
        wait_for_status(api, done["id"], {"completed"})
        submit(api, [chat_line(f"running-{i}") for i in range(400)])
    for width in WIDTHS:
        context = browser.new_context(viewport={"width": width, "height": 800})
        try:
            page = context.new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(server.base_url + "/")
            page.wait_for_selector(f'tr[data-batch-id="{done["id"]}"]')
            page.click(f'tr[data-batch-id="{done["id"]}"]')
            page.wait_for_selector("#detail .result")
            page.wait_for_timeout(300)  # the gauges' and bars' transitions
            layout = _layout(page)
            assert layout["viewport"] == width
            assert layout["scrollWidth"] <= width, layout
            assert layout["header"][0] <= 0.5 and layout["header"][1] >= width - 0.5, layout
            assert layout["outside"] == [], layout
            assert layout["cards"] == [], layout
            assert layout["spills"] == [], layout
            assert layout["rows"] == 2
            shot = tmp_path / f"dashboard-{width}.png"
            page.screenshot(path=str(shot), full_page=True)
            assert _png_size(shot)[0] == width
            if width < 720:  # a phone: the table is a list of labelled cards
                assert page.is_hidden("#batches thead")
                label = page.evaluate(
                    "() => getComputedStyle(document.querySelector('#batch-rows td'), '::before').content"
                )
                assert label == '"Batch"'
            else:
                assert page.is_visible("#batches thead")
        finally:
            context.close()


def test_latest_results_show_id_status_and_first_words_with_the_raw_line_a_click_away(
    server_factory: Callable[..., LiveServer], page: Page
) -> None:
    server = server_factory("--max-context-length", "50")
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        batch = submit(api, [chat_line("good-one"), chat_line("too-long", "word " * 200)])
        output = wait_for_status(api, batch["id"], {"completed"})["output_file_id"]
        records = [json.loads(line) for line in api.get(f"/v1/files/{output}/content").text.splitlines()]
        lines = {record["custom_id"]: record for record in records}
    page.goto(server.base_url + "/")
    page.click(f'tr[data-batch-id="{batch["id"]}"]')
    page.wait_for_selector('#detail .result[data-custom-id="too-long"]')
    good = page.locator('#detail .result[data-custom-id="good-one"]')
    bad = page.locator('#detail .result[data-custom-id="too-long"]')
    assert good.get_attribute("data-status") == "completed"
    assert bad.get_attribute("data-status") == "failed"
    answer = lines["good-one"]["response"]["body"]["choices"][0]["message"]["content"]
    summary = good.locator("summary").inner_text()
    assert "good-one" in summary and "completed" in summary
    assert " ".join(answer.split()[:3]) in summary
    assert "context_length_exceeded" in bad.locator("summary").inner_text()
    # the raw line is hidden until its summary is clicked, then shown whole, not cut off
    assert not good.locator("pre.raw").is_visible()
    good.locator("summary").click()
    assert good.locator("pre.raw").is_visible()
    assert json.loads(good.locator("pre.raw").inner_text()) == lines["good-one"]
    box = page.eval_on_selector('#detail .result[data-custom-id="good-one"] pre.raw',
                                "pre => [pre.scrollWidth, pre.clientWidth]")  # fmt: skip
    assert box[0] <= box[1]  # wrapped, not cut off mid-line


def test_no_request_of_the_page_is_refused_and_the_favicon_is_served(
    live_server: LiveServer, page: Page
) -> None:
    failed: list[str] = []
    page.on("response", lambda response: failed.append(f"{response.status} {response.url}")
            if response.status >= 400 else None)  # fmt: skip
    page.goto(live_server.base_url + "/")
    page.wait_for_function("() => document.getElementById('updated').textContent.startsWith('updated')")
    icon = page.evaluate(
        """async () => {
            const response = await fetch('/favicon.ico');
            return [response.status, response.headers.get('content-type'), (await response.arrayBuffer()).byteLength];
        }"""
    )
    assert icon[0] == 200 and icon[1] == "image/x-icon" and icon[2] > 0
    assert page.get_attribute('link[rel="icon"]', "href") == "/favicon.ico"
    assert failed == []


PLACEHOLDERS = ("checking", "loading")


def test_the_first_paint_holds_the_servers_state(
    server_factory: Callable[..., LiveServer], browser: Browser, tmp_path: Path
) -> None:
    """A screenshot taken as soon as the page has loaded shows health, the pools and the batches,
    never "checking…" or "loading…"; with scripts off (the HTML as it arrives) as well."""
    server = server_factory(*FLAGS)
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        batch = submit(api, [chat_line(f"r{i}") for i in range(3)])
        wait_for_status(api, batch["id"], {"completed"})
    for scripts in (True, False):
        context = browser.new_context(viewport={"width": 1280, "height": 900}, java_script_enabled=scripts)
        try:
            page = context.new_page()
            page.goto(server.base_url + "/", wait_until="domcontentloaded")
            shot = tmp_path / f"first-paint-{'scripts' if scripts else 'html'}.png"
            page.screenshot(path=str(shot))
            text = page.inner_text("body")
            assert not [word for word in PLACEHOLDERS if word in text.lower()], text
            assert page.inner_text("#health") == "healthy"
            assert page.get_attribute("#health", "data-state") == "healthy"
            assert page.locator(f'tr[data-batch-id="{batch["id"]}"]').count() == 1
            assert "3/3" in page.inner_text(f'tr[data-batch-id="{batch["id"]}"]')
            assert page.inner_text("#active-batches") == "0"
            assert page.inner_text("#slots-text").startswith("running on the engine")
        finally:
            context.close()


def test_with_api_keys_the_first_paint_holds_health_and_asks_for_a_key(
    tmp_path: Path, server_factory: Callable[..., LiveServer], page: Page
) -> None:
    storage = tmp_path / "keyed"
    storage.mkdir()
    _, key = create_key(storage, "alice")
    server = server_factory(storage="keyed")
    with authorized(server.base_url, key) as alice:
        own = submit(alice, [chat_line("alice-line")])
    page.goto(server.base_url + "/", wait_until="domcontentloaded")
    text = page.inner_text("body")
    assert not [word for word in PLACEHOLDERS if word in text.lower()], text
    assert page.inner_text("#health") == "healthy"
    assert own["id"] not in page.content()
    page.wait_for_selector("#key-prompt[open]")
    page.fill("#key-input", key)
    page.click("#key-submit")
    page.wait_for_selector(f'tr[data-batch-id="{own["id"]}"]')


def test_a_batch_links_to_its_retries_and_a_retry_to_the_batch_it_retries(
    server_factory: Callable[..., LiveServer], page: Page
) -> None:
    server = server_factory("--max-context-length", "50")
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        batch = submit(api, [chat_line("fine"), chat_line("too-long", "word " * 200)])
        wait_for_status(api, batch["id"], {"completed"})
        retry = api.post(f"/v1/batches/{batch['id']}/retry", json={}).json()
        wait_for_status(api, retry["id"], {"completed"})
    page.goto(server.base_url + "/")
    page.click(f'tr[data-batch-id="{batch["id"]}"]')
    link = page.locator(f'#detail-fields dd[data-field="retries"] a[data-batch-link="{retry["id"]}"]')
    link.wait_for()
    assert (
        page.locator('#detail-fields dd[data-field="retry_of"]').inner_text() == "\u2013"
    )  # the dash of an empty field
    link.click()
    page.wait_for_function("id => document.getElementById('detail-id').textContent === id", arg=retry["id"])
    back = page.locator(f'#detail-fields dd[data-field="retry_of"] a[data-batch-link="{batch["id"]}"]')
    back.wait_for()
    assert (
        page.locator('#detail-fields dd[data-field="retries"]').inner_text() == "\u2013"
    )  # the dash of an empty field
    back.click()
    page.wait_for_function("id => document.getElementById('detail-id').textContent === id", arg=batch["id"])


def test_the_details_show_the_order_of_the_batch_s_results(
    server_factory: Callable[..., LiveServer], page: Page
) -> None:
    server = server_factory()
    with httpx.Client(base_url=server.base_url, timeout=30) as api:
        ordered = submit(api, [chat_line("a"), chat_line("b")], output_order="input")
        plain = submit(api, [chat_line("c")])
        for batch in (ordered, plain):
            wait_for_status(api, batch["id"], {"completed"})
    page.goto(server.base_url + "/")
    for batch, shown in ((ordered, "input order"), (plain, "completion order")):
        page.click(f'tr[data-batch-id="{batch["id"]}"]')
        page.wait_for_function(
            "id => document.getElementById('detail-id').textContent === id", arg=batch["id"]
        )
        page.wait_for_function(
            "text => document.getElementById('detail-fields').textContent.includes(text)", arg=shown
        )


def test_selecting_a_batch_brings_its_details_into_view_on_a_small_screen(
    live_server: LiveServer, browser: Browser
) -> None:
    """The details open below the table: on a small screen, out of sight, unless the page scrolls
    to them when a row is clicked."""
    with httpx.Client(base_url=live_server.base_url, timeout=30) as api:
        batches = [submit(api, [chat_line(f"seen-{i}")]) for i in range(4)]
        for batch in batches:
            wait_for_status(api, batch["id"], {"completed"})
    context = browser.new_context(viewport={"width": 360, "height": 560})
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(live_server.base_url + "/")
        row = f'tr[data-batch-id="{batches[-1]["id"]}"]'  # the newest: the first row, far above the details
        page.click(row)
        page.wait_for_function(
            "id => document.getElementById('detail-id').textContent === id", arg=batches[-1]["id"]
        )
        page.wait_for_function(
            """() => {
                const box = document.getElementById('detail').getBoundingClientRect();
                return box.top >= 0 && box.top < window.innerHeight && box.bottom > 0;
            }"""
        )
    finally:
        context.close()


MAXIMA = (0.0004, 0.0007, 0.003, 0.01, 0.04, 0.1, 0.13, 0.6, 1, 2.2, 7, 12, 99, 250, 999, 4_321, 60_000, 1e6)


def test_the_plots_value_labels_are_distinct_and_readable_at_any_scale(
    live_server: LiveServer, page: Page
) -> None:
    """Small rates drew "0.1, 0.0, 0.0, 0.0": every axis, from a peak of 0.0004 to a million, has
    five distinct labels, each short enough for the axis, increasing with the value they mark."""
    page.goto(live_server.base_url + "/")
    page.wait_for_selector("#requests-plot[data-ticks]")
    axes: list[list[str]] = page.evaluate(
        "maxima => maxima.map((peak) => BatchGenDashboard.tickLabels(BatchGenDashboard.niceCeiling(peak)))",
        list(MAXIMA),
    )
    for peak, labels in zip(MAXIMA, axes, strict=True):
        assert len(set(labels)) == 5 and labels[0] == "0", (peak, labels)
        assert all(len(label) <= 9 for label in labels), (peak, labels)
        units = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
        values = [
            float(label[:-1]) * units[label[-1]] if label[-1] in units else float(label) for label in labels
        ]
        assert values == sorted(values) and values[-1] >= peak, (peak, labels)
    # and the plot draws them: a server whose requests end at 0.0004 a second
    page.route(
        "**/v1/pool/status",
        lambda route: route.fulfill(
            json={**route.fetch().json(), "requests_per_second": 0.0004},
            headers={"Cache-Control": "no-store"},
        ),
    )
    page.wait_for_function(
        "() => document.getElementById('requests-plot').dataset.ticks === '0 0.000125 0.00025 0.000375 0.0005'"
    )


def test_an_engine_that_cannot_tell_does_not_blank_what_the_others_report(
    live_server: LiveServer, page: Page
) -> None:
    """The default setup: a chat model whose backend counts what its engine runs beside an
    embeddings model whose backend cannot. The card shows the first's figure and names the
    second, rather than "cannot tell" for both (here the server's answer gets that second model)."""

    def with_a_silent_model(route: Route) -> None:
        pool = route.fetch().json()
        pool["engines"] = [*pool["engines"], {"model": "embed", "running": None, "generated_tokens": None}]
        route.fulfill(json={**pool, "engine_running": None, "engine_waiting": None})

    page.route("**/v1/pool/status", with_a_silent_model)
    page.goto(live_server.base_url + "/")
    page.wait_for_function(
        "() => document.getElementById('slots-text').textContent.startsWith('running on the engine: 0 (simulated: 0)')"
    )
    text = page.inner_text("#slots-text")
    assert "embed: its backend cannot tell" in text and "cannot tell how many of them" not in text


# --- the replicas table (a server that is one of several) --------------------------------------------


def test_a_killed_replica_is_shown_not_reporting_and_the_replicas_fit_a_phone(
    postgres_url: str, tmp_path: Path, browser: Browser
) -> None:
    """Replica b dies (SIGKILL): within a few report intervals a's pool status and its Replicas
    table say b is not reporting, long before b's reports drop out of the list (three leases, 30 s
    here). At 360 and 420 px every column of the table is on screen, as labelled cards, without
    sideways scrolling."""
    import signal

    from tests.replica_fleet import Blobs, start_replica

    blobs = Blobs(f"file://{tmp_path / 'shared'}")
    a = start_replica(tmp_path, postgres_url, blobs, "a", lease_s=10)
    b = start_replica(tmp_path, postgres_url, blobs, "b", lease_s=10)
    try:
        for width in (360, 420):
            context = browser.new_context(viewport={"width": width, "height": 800})
            try:
                page = context.new_page()
                page.set_default_timeout(WAIT_MS)
                page.goto(a.base_url + "/")
                page.wait_for_selector('#replica-rows tr[data-replica-id="a"]')
                page.wait_for_selector('#replica-rows tr[data-replica-id="b"]')
                if width == 360:
                    b.process.send_signal(signal.SIGKILL)
                    b.process.wait()
                    page.wait_for_selector('#replica-rows tr[data-replica-id="b"][data-reporting="false"]')
                    assert "not reporting" in page.inner_text(
                        'tr[data-replica-id="b"] td[data-label="Health"]'
                    )
                    listed = {r["id"]: r for r in httpx.get(f"{a.api_url}/pool/status").json()["replicas"]}
                    assert listed["b"]["reporting"] is False and listed["b"]["healthy"] is False
                    assert listed["a"]["reporting"] is True
                layout = page.evaluate(
                    """() => {
                        const section = document.getElementById('replicas').getBoundingClientRect();
                        const cells = [...document.querySelectorAll('#replica-rows td')];
                        const wrap = document.querySelector('#replicas .table-wrap');
                        return {
                            scrollWidth: document.scrollingElement.scrollWidth,
                            wrapScrolls: wrap.scrollWidth > wrap.clientWidth + 1,
                            cells: cells.length,
                            outside: cells.filter((td) => {
                                const r = td.getBoundingClientRect();
                                return r.width === 0 || r.left < section.left - 0.5 || r.right > section.right + 0.5;
                            }).map((td) => td.dataset.label),
                            header: getComputedStyle(document.querySelector('#replicas thead')).display,
                            label: getComputedStyle(cells[cells.length - 1], '::before').content,
                        };
                    }"""
                )
                assert layout["scrollWidth"] <= width, layout
                assert not layout["wrapScrolls"], layout
                assert layout["cells"] == 14 and layout["outside"] == [], layout
                assert layout["header"] == "none" and layout["label"] == '"Reported"', layout
            finally:
                context.close()
    finally:
        a.stop()
        b.stop()
