"""The web page in headless Chromium (Debian's package, driven by Playwright): leak listed, timeline reached."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from api.app import create_app
from tests.api.conftest import ServerThread, seed, settings_for
from tests.api.seed import AUDIT_NOW

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync",
]  # fmt: skip
SHARED_SCREENSHOT = Path("/tmp/kvledger-screenshot.png")


@pytest.mark.browser
def test_sre_finds_the_leak_and_reads_its_timeline(sqlite_url: str, tmp_path: Path) -> None:
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    seed(sqlite_url)
    with ServerThread(create_app(settings_for(sqlite_url))) as base, playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{base}/?now={AUDIT_NOW}")
            first = page.locator("#leaks tr.finding").first
            assert first.get_attribute("data-code") == "leak"
            assert "tx-leak" in first.inner_text()
            page.screenshot(path=str(tmp_path / "leaks.png"), full_page=True)
            first.get_by_role("link", name="tx-leak").click()
            page.wait_for_selector("svg#timeline circle")
            assert "still held" in page.inner_text("main")
            assert page.locator("svg#timeline text.decision").first.text_content().endswith("deadline, still held")
            assert "p-leak (read mode) holds 4 blocks" in page.inner_text("#events")
            page.goto(f"{base}/ui/transfers/tx-ok")
            page.wait_for_selector("svg#timeline circle")
            assert "released (completed)" in (page.locator("svg#timeline").text_content() or "")
            page.goto(f"{base}/ui/transfers/tx-leak?now={AUDIT_NOW}")
            shot = tmp_path / "timeline.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    shutil.copyfile(shot, SHARED_SCREENSHOT)
    assert shot.stat().st_size > 0
