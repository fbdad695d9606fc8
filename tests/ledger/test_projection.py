"""The service's fold of stored rows (`kvledger.ledger.projection.fold_rows`): what it keeps beside the fold is what
the rows say, and an event the fold raises on is handed back while the rest are folded. Runs on whichever
build loads (the compiled one and, in CI's second pass, the sources); tests/ledger/both_builds.py compares
the two on generated histories."""

from __future__ import annotations

import pytest

from kvledger.ledger.events import KINDS
from kvledger.ledger.fold import LedgerState
from tests.ledger.builders import ServiceFold, Side, apply_raising_on


def test_order_requests_counts_and_newest_ts_are_what_the_rows_say() -> None:
    p, d = Side("prefill-0/tp0"), Side("decode-0/tp0")
    kept = ServiceFold()
    # A side first seen by an ack (its map comes later), a request mapped on two sources, a refused
    # second map of a used id, and a clock that steps back.
    early = d.ack("t2", "recv", ts=1000.5)
    assert kept.fold([p.map("t1", "r1"), early, d.map("t2", "r1", role="consumer")]) == []
    assert kept.fold([p.map("t1", "r9"), p.ack("t1", "release", ts=999.0), p.map("t3", "r3")]) == []
    assert kept.order == [("prefill-0/tp0", "t1"), ("decode-0/tp0", "t2"), ("prefill-0/tp0", "t3")]
    assert kept.by_request == {
        "r1": (("prefill-0/tp0", "t1"), ("decode-0/tp0", "t2")),
        "r9": (("prefill-0/tp0", "t1"),),  # the refused map names its request (id_reuse)
        "r3": (("prefill-0/tp0", "t3"),),
    }
    assert kept.by_kind == {**dict.fromkeys(KINDS, 0), "map": 4, "ack": 2}
    # The prefill's events came at 1000.01, 1000.02, then 999.0 and 999.01 (its clock stepped back).
    assert kept.last_ts == {"prefill-0/tp0": pytest.approx(1000.02), "decode-0/tp0": pytest.approx(1000.51)}


def test_each_release_is_told_with_how_long_its_side_held_and_the_series_follows_the_blocks() -> None:
    p = Side("prefill-0/tp0", start_ts=100.0, step_s=1.0)
    kept = ServiceFold()
    kept.fold([p.map("a", "r1", blocks=(1, 2, 3)), p.map("b", "r2", blocks=(4,)), p.ack("a", "release")])
    [(release, held_s)] = kept.told
    assert (release.transfer_id, release.cause) == ("a", "completed")
    assert held_s == pytest.approx(2.0)
    assert kept.latency.completed.count == 1
    points = kept.holding.points("prefill-0/tp0")
    assert max(point.peak for point in points) == 4 and points[-1].last == 1


def test_an_event_the_fold_raises_on_is_handed_back_and_the_rest_are_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LedgerState, "apply", apply_raising_on("boom"))
    p = Side("prefill-0/tp0")
    kept = ServiceFold()
    bad = p.map("boom", "r2")
    failed = kept.fold([p.map("before", "r1"), bad, p.map("after", "r3")])
    assert [(cursor, event) for cursor, event, _ in failed] == [(2, bad)]
    assert isinstance(failed[0][2], RuntimeError) and str(failed[0][2]) == "a fold bug"
    assert [key[1] for key in kept.order] == ["before", "after"]
    assert kept.by_kind["map"] == 2, "the event that raised is not counted"
