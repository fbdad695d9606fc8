"""The held plot over a source that restarts and later goes silent: its line, its cross and its end label
all say the blocks its last process held, the figure its health (and the page's card) gives."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvledger.api.app import create_app
from kvledger.connector.store import abandon_inherited
from kvledger.ledger.events import Event, Map, ReqId, TransferId
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.recovery import open_ledger
from tests.api.conftest import settings_for
from tests.api.html import Element, parse
from tests.ledger.builders import Side

T0 = 10_000.0
SOURCE = "prefill-0/tp0"
FIRST_LIFE_SIDES, SECOND_LIFE_SIDES = 5, 3
BLOCKS_PER_SIDE = 2
RESTART_STAMP = T0 + 30.0
"""The restarted process's clock when it fails what its previous process held: ahead of the events it records
next (a clock stepped back after the start; the demo's storm stamps its restart with the wall clock, ahead of
its simulated one). The fold holds the source's blocks in the order its events came, whatever their stamps."""
SECOND_LIFE_TS = T0 + 10.0
NOW = T0 + 100.0
TIMEOUTS = {"transfer_timeout_s": 1.0, "defer_timeout_s": 2.0}


def _restarted_source(url: str) -> None:
    """First life: maps, then gone. Second life: the store reopened, the inherited sides failed, new maps
    held when it too goes silent."""
    first = Side(SOURCE, start_ts=T0)
    store = open_store(url, create=True)
    try:
        store.append([
            first.map(f"tx-first-{i}", f"r-first-{i}", blocks=(2 * i, 2 * i + 1), deadline=T0 + 50)
            for i in range(FIRST_LIFE_SIDES)
        ])  # fmt: skip
        ledger = open_ledger(store, SOURCE, clock=lambda: RESTART_STAMP)
        written: list[Event] = []
        ledger.log.subscribe(written.append)
        assert abandon_inherited(ledger) == FIRST_LIFE_SIDES
        for i in range(SECOND_LIFE_SIDES):
            blocks = tuple(range(100 + BLOCKS_PER_SIDE * i, 100 + BLOCKS_PER_SIDE * (i + 1)))
            ledger.record(
                Map, ts=SECOND_LIFE_TS + i, transfer_id=TransferId(f"tx-second-{i}"),
                request_id=ReqId(f"r-second-{i}"), role="producer", mode="read", block_ids=blocks,
                acks_expected=1, deadline=SECOND_LIFE_TS + 50,
            )  # fmt: skip
        assert ledger.state.blocks_held == SECOND_LIFE_SIDES * BLOCKS_PER_SIDE
        store.append(written)
        ledger.close()
    finally:
        store.close()


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[TestClient]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    _restarted_source(url)
    with TestClient(create_app(settings_for(url, **TIMEOUTS))) as client:
        yield client


def _level_of(plot: Element, y_px: float) -> float:
    """The count the held plot's axis puts at `y_px`, read from its tick labels (linear)."""
    ticks = [(float(t.attrs["y"]), int(t.text.replace(",", ""))) for t in plot.find_all("text.tick")
             if t.attrs.get("text-anchor") == "end"]  # fmt: skip
    (y_low, low), (y_high, high) = max(ticks), min(ticks)  # the axis' foot and top (y grows downwards)
    return low + (y_low - 4 - y_px) * (high - low) / (y_low - y_high)  # a tick's label sits 4 px below it


def test_a_restarted_source_that_went_silent_ends_at_the_blocks_it_held(restarted: TestClient) -> None:
    response = restarted.get("/", params={"now": NOW})
    assert response.status_code == 200, response.text
    document = parse(response.text)
    held = SECOND_LIFE_SIDES * BLOCKS_PER_SIDE
    cross = document.find("#plot-held").find("g.lost-mark")
    assert cross.attrs["data-source"] == SOURCE
    assert f"holding {held:,} blocks" in cross.find("title").text
    plot = document.find("#plot-held")
    match = re.match(r"M([\d.]+),([\d.]+)", cross.find("path").attrs["d"])
    assert match is not None
    assert _level_of(plot, float(match.group(2)) + 5) == pytest.approx(held, abs=0.1)
    labels = [t.text for t in plot.find_all("text.end-label")]
    assert labels == [f"{SOURCE} · lost, {held:,}"]
    dashed = next(p for p in plot.find_all("path") if p.attrs.get("stroke-dasharray") == "6,4")
    ys = {float(y) for y in re.findall(r"[ML][\d.]+,([\d.]+)", dashed.attrs["d"])}
    assert len(ys) == 1 and _level_of(plot, ys.pop()) == pytest.approx(held, abs=0.1)
    line = plot.find("g.series").find("path").attrs["d"]
    assert _level_of(plot, float(re.findall(r",([\d.]+)", line)[-1])) == pytest.approx(held, abs=0.1)
