"""The playground in a real headless Chromium (Debian's, driven by Playwright): two turns with the second's cached
share drawn, a recompute without the cache, a fork, a stream stopped, API keys, and a screenshot.

docs/playground.png, which the README shows, is the same flow on the default model: bench/playground_shot.py."""

from __future__ import annotations

import os

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.helpers import wait_until
from tests.http import playground_driver as drive
from tests.http.conftest import serve_live, wait_ready

KEY = "sk-playground-01"


def browser_or_skip():
    """CI sets KVSERVE_REQUIRE_BROWSER=1 (.ci/run installs Chromium): there a missing browser fails, never skips."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = [
        what for what, ok in (("playwright", sync_playwright), ("chromium", os.path.exists(drive.CHROMIUM))) if not ok
    ]
    if missing and os.environ.get("KVSERVE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"the playground test needs {' and '.join(missing)}: .ci/run installs them")
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed")
    return sync_playwright


@pytest.fixture(scope="module")
def site(tiny_spec):
    settings = Settings(api_keys=f"{KEY}:alice", default_max_tokens=16, metrics_needs_key=True)
    with serve_live([tiny_spec], settings) as (base, engine):
        yield base, engine


@pytest.fixture(scope="module")
def page(site):
    sync_playwright = browser_or_skip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=drive.CHROMIUM, headless=True, args=drive.ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        context.add_init_script(drive.RECORD_VIOLATIONS)
        yield context.new_page()
        browser.close()


def test_two_turns_a_recompute_a_fork_and_a_stopped_stream(site, page, tmp_path):
    base, engine = site
    auth = {"Authorization": f"Bearer {KEY}"}
    drive.open_with_key(page, base, KEY)
    parent = drive.new_session(page, "You are a careful assistant. " * 4)
    drive.send(page, "Hello there")
    drive.send(page, "Tell me more")
    first, second = (turn.locator("[data-testid=turn-bar]") for turn in drive.turns(page))
    assert int(first.get_attribute("data-cached")) > 0  # the system prompt, prefilled at creation
    cached, computed = int(second.get_attribute("data-cached")), int(second.get_attribute("data-computed"))
    assert cached > computed  # turn 2 reused turn 1's whole transcript: only its new tokens were computed
    assert second.get_attribute("data-source") == "device"
    assert (
        second.locator(".cached.device").bounding_box()["width"] > second.locator(".computed").bounding_box()["width"]
    )
    assert page.locator("svg[data-testid=ttft-chart] rect.with-cache").count() == 2

    drive.recompute(page, 1)
    assert "without the cache" in drive.turns(page)[1].locator("[data-testid=turn-stats]").inner_text()
    page.wait_for_function("() => document.querySelector('[data-testid=sessions]').textContent.includes('device')")
    assert "blocks in use" in page.locator("[data-testid=pool]").inner_text()  # the pool's usage, from /metrics
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert (tmp_path / "playground.png").stat().st_size > 10_000

    drive.turns(page)[0].locator("[data-testid=fork]").click()
    page.wait_for_function(
        f"() => !document.querySelector('[data-testid=session-name]').textContent.includes('{parent}')"
    )
    assert len(drive.turns(page)) == 1  # the fork holds the parent's first turn
    forked = page.locator("[data-testid=session-name]").inner_text().removeprefix("session ")
    described = httpx.get(f"{base}/v1/sessions/{forked}", headers=auth).json()
    assert (described["turns"], described["parent"]) == (1, parent)

    page.fill("[data-testid=max-tokens]", "3000")
    page.fill("[data-testid=message]", "Now write at length")
    page.click("[data-testid=send]")
    streaming = "[data-testid=turn][data-status=streaming] .assistant"
    page.wait_for_function(f"() => document.querySelector('{streaming}').textContent.length > 0", timeout=drive.WAIT_MS)
    page.click("[data-testid=stop]")
    page.wait_for_function("() => document.querySelector('[data-testid=turns]').dataset.stopped === 'true'")
    wait_until(lambda: engine.num_active == 0, 30, "the stopped stream's generation to end")
    assert len(drive.turns(page)) == 1  # a stopped turn is not a turn
    assert httpx.get(f"{base}/v1/sessions/{forked}", headers=auth).json()["turns"] == 1
    assert drive.violations(page) == []  # the page's Content-Security-Policy blocked nothing it does


def test_the_page_and_its_files_need_no_key_and_can_be_turned_off(tiny_spec, site):
    base, _ = site
    for path in (
        "/",
        "/playground",
        "/playground/static/app.js",
        "/playground/static/api.js",
        "/playground/static/style.css",
    ):
        assert httpx.get(base + path).status_code == 200, path
    assert httpx.get(base + "/v1/sessions").status_code == 401  # what the page calls still needs the key
    with TestClient(create_app(Settings(playground=False), specs=[tiny_spec])) as off:
        wait_ready(off)
        assert off.get("/").status_code == 404
        assert off.get("/playground/static/app.js").status_code == 404
        assert off.get("/health").status_code == 200
