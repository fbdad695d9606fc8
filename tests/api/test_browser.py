"""The web page in headless Chromium (Debian's package, driven by Playwright), over the demo's own store.

Assertions are on what a person sees (counts, the lost engine, durations, the plots' marks), each checked
against the storm's own figures; every page visited is saved as a screenshot (see `ARTIFACTS`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger.api.app import create_app
from kvledger.cli.demo import demo_settings, run_demo_storm, wait_for_storm_end
from tests.api.conftest import ServerThread, settings_for
from tests.api.test_page import DEAD, LEAKY, NOW, TIMEOUTS, store_with, storm

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync",
]  # fmt: skip
ARTIFACTS = Path(os.environ.get("KVLEDGER_SCREENSHOTS", "/tmp/kvledger-screenshots"))
"""Every screenshot lands here too (the test's own tmp dir is deleted in time): a stable place to look."""
DEMO_STORM = {"requests": 400, "concurrency": 64, "seed": 1, "mode": "read"}
"""The demo's storm, smaller: every fault kind, and the peer death the demo always has."""
HUMAN_DURATION = re.compile(r"^\d+(\.\d)? (µs|ms|s)$|^\d+ (min|h|d)( \d+ (s|min|h))?$")

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with playwright_api.sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """(base URL, storm result): the demo's storm on its SQLite ledger, served as `kvledger demo` serves it."""
    result, config = run_demo_storm(tmp_path_factory.mktemp("demo"), **DEMO_STORM)  # type: ignore[arg-type]
    assert result.ok, result.problems
    assert result.dead_engine is not None, "the demo's storm always kills an engine"
    wait_for_storm_end(result, config)
    with ServerThread(create_app(demo_settings(result, config))) as base:
        yield base, result


def shoot(page: Any, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, ARTIFACTS / name)
    print(f"\nscreenshot: {ARTIFACTS / name}")
    return shot


def number(text: str) -> int:
    return int(text.strip().replace(",", ""))


def test_the_demo_page_says_which_engine_died_and_that_nothing_leaked(
    demo: tuple[str, Any], browser: Any, tmp_path: Path
) -> None:
    base, result = demo
    dead_findings = {code: n for code, n in result.findings_on_dead_engine.items() if n}
    live_leaks = result.findings.get("leak", 0) - dead_findings.get("leak", 0)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{base}/")
    head = "1 engine lost; nothing wrong on live engines"
    assert (page.title(), page.locator("h1#headline").inner_text()) == (f"{head} · kvledger", head)
    lost_line = page.locator("p.verdict.lost").first.inner_text()
    assert lost_line.startswith(f"Engine {result.dead_engine} is lost, known dead: killed by the demo's storm")
    assert number(page.locator("#card-leaks b").inner_text()) == live_leaks == 0
    assert page.locator("p.verdict.ok").count() == 1, "the survivor holds nothing: the demo printed 0 blocks held"
    row = page.locator(f"tr.lost-engine[data-engine='{result.dead_engine}']")
    counts_text = row.locator("td").last.inner_text()
    on_dead = {m.group(1): number(m.group(2)) for m in re.finditer(r"(\w+) ([\d,]+)", counts_text)}
    assert on_dead == dead_findings, "the page's lost engine carries the findings the demo printed for it"
    lost_blocks = number(page.locator("#card-blocks-lost b").inner_text())
    held_by_lost = page.locator("tr.source[data-state='lost'] td.num").all_inner_texts()[1::2]  # (sides, blocks)
    assert lost_blocks == sum(number(t) for t in held_by_lost) > 0
    assert HUMAN_DURATION.match(page.locator("#card-p99 b").inner_text())
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC", page.locator("#audit-time").inner_text())
    # The plots: a line per source, the dead engine's crosses, both timeouts, findings on the lost engine.
    assert page.locator("#plot-held g.series").count() == len(page.locator("tr.source").all())
    lost_sources = {s for s in page.locator("#plot-held g.lost-mark").evaluate_all("m => m.map(e => e.dataset.source)")}
    assert lost_sources and all(s.startswith(f"{result.dead_engine}/") for s in lost_sources)
    assert page.locator("#plot-latency line.timeout").count() == 2
    assert page.locator("#plot-findings g.finding-bar[data-code='on lost engines']").count() > 0
    shoot(page, tmp_path, "demo-overview.png")

    group = page.locator("details.group.lost[data-code='leak']").first
    group.locator("summary").click()
    assert group.locator("tr.finding").first.is_visible()
    count = number(group.get_attribute("data-count") or "0")
    page.locator("details.group.lost[data-code='leak'] a.all").first.click()
    assert number(page.locator("#group").get_attribute("data-count") or "0") == count
    shoot(page, tmp_path, "demo-lost-group.png")
    page.locator("#group-findings tr.finding a").first.click()
    page.wait_for_selector("svg#timeline circle")
    assert "held when its engine was lost" in (page.locator("svg#timeline").text_content() or "")
    ticks = page.locator("svg#timeline text.tick").all_text_contents()
    assert ticks and all(HUMAN_DURATION.match(t.removeprefix("+")) for t in ticks), ticks
    shoot(page, tmp_path, "demo-lost-transfer.png")
    page.close()


def test_an_sre_finds_a_live_leak_and_reads_its_timeline(browser: Any, tmp_path: Path) -> None:
    url = store_with(tmp_path / "ledger.db", storm())
    with ServerThread(create_app(settings_for(url, **TIMEOUTS))) as base:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{base}/?now={NOW}")
        first = page.locator("details.group").first
        assert (first.get_attribute("data-code"), first.get_attribute("data-source")) == ("leak", LEAKY)
        assert page.title() == "120 leaks, 1 warning on live engines; 1 engine lost · kvledger"
        assert page.locator("p.verdict.bad").first.inner_text().startswith("120 leaks on live engines")
        assert page.locator(f"tr.source[data-source='{DEAD}']").get_attribute("data-state") == "lost"
        assert page.locator("#plot-held g.leak-mark").count() > 0
        shoot(page, tmp_path, "live-leak-overview.png")
        first.locator("summary").click()
        first.locator("tr.finding a").first.click()
        page.wait_for_selector("svg#timeline circle")
        assert page.locator("svg#timeline text.decision").first.text_content().endswith("deadline, still held")
        assert "1 block held 1 min 38 s past the deadline" in page.inner_text("main")
        shoot(page, tmp_path, "live-leak-timeline.png")
        page.close()


def test_the_store_problem_page_has_no_all_clear(browser: Any, tmp_path: Path) -> None:
    broken = tmp_path / "ledger.db"
    broken.write_text("not a ledger\n")
    with ServerThread(create_app(settings_for(f"sqlite:///{broken}"))) as base:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{base}/")
        assert page.title() == "Not known whether anything is wrong · kvledger"
        assert page.locator("#card-leaks b").inner_text() == "not known"
        problem = page.locator("div.problem[data-kind='store']")
        assert problem.is_visible() and "cannot be read" in problem.inner_text()
        assert page.locator("div.problem").first.bounding_box()["y"] < 120, "the problem is the first thing seen"
        assert page.locator("p.verdict.ok").count() == 0
        assert "No findings" not in page.inner_text("body")
        shoot(page, tmp_path, "store-problem.png")
        page.close()
