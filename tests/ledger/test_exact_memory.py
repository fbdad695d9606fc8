"""Exact id memory (DESIGN.md, "Long runs"): a transfer's decisions and findings depend only on its own events,
never on how much memory the fold gave to other transfers.

- The property: generated histories 100 id windows long (every fault kind, stamped and unstamped ids, ids
  colliding, late events and reused ids inside and past the window) give the same releases and findings with
  every memory bound at its default, at 1/100 of it, and off.
- Rule S (ledger/upkeep.py): an event of a stamped id past its window, on a side not held open, is judged by
  the event alone, the same whether the side's tombstone is held or retired.
- Memory for stamped ids stays bounded by the window: held tombstones stay below rate x (window + lag).
- The 4M-event log of issue 37 completes the fresh transfer a count-bounded memory refused (slow).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import kvledger.ledger.replay as replay_module
import kvledger.ledger.upkeep as upkeep_module
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.ids import issued_at, stamped_id
from kvledger.ledger.limits import (
    ARRIVAL_LAG_S,
    DEFAULT_DEFER_TIMEOUT_S,
    ID_WINDOW_S,
    REPLAY_COMPACT_EVERY,
    REPLAY_RETAIN_S,
)
from kvledger.ledger.merge import batched
from kvledger.ledger.replay import ReplayResult, replay_chunks
from kvledger.ledger.store import snapshot
from kvledger.ledger.summary import compaction_warning
from kvledger.ledger.synth import SynthConfig, generate, synth_transfer_id
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, audit_moments, history
from tests.ledger.reference import canonical

WINDOWS = 100
CENTURY = Shape(
    transfers=400, span_s=WINDOWS * ID_WINDOW_S, late_gap_s=2 * ID_WINDOW_S, faults_per_side=0.4,
    reuse_rate=0.2, orphan_rate=0.1, premature_rate=0.2, block_pool=8, stamped_rate=0.7, issue_lead_s=30.0,
    consumers=("decode-0/tp0", "decode-1/tp0"),
)  # fmt: skip
"""A hundred id windows: late events up to two windows after a side's last one (inside and past its window),
reused ids drawn from the whole history before (mostly past their window), few block ids (collisions)."""
CROWDED = Shape(
    transfers=300, span_s=WINDOWS * ID_WINDOW_S / 10, late_gap_s=1.5 * ID_WINDOW_S, faults_per_side=2.0,
    reuse_rate=0.3, orphan_rate=0.15, premature_rate=0.3, block_pool=4, stamped_rate=0.5, issue_lead_s=5.0,
)  # fmt: skip
"""Ten windows, denser: more ids reused and late events inside their window, on retired and held sides."""

PROPERTY = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _replay(events: list[Event], *, scale: float | None) -> ReplayResult:
    """A replay with every memory bound at `scale` of its default (None: off, nothing compacted or retired)."""
    if scale is None:
        return replay_chunks(batched(events, 64), compact_every=None)
    with (
        mock.patch.object(upkeep_module, "ARRIVAL_LAG_S", ARRIVAL_LAG_S * scale),
        mock.patch.object(replay_module, "REPLAY_RETAIN_S", REPLAY_RETAIN_S * scale),
    ):
        return replay_chunks(batched(events, 16), compact_every=max(1, int(REPLAY_COMPACT_EVERY * scale)))


def _running(events: list[Event], *, scale: float) -> tuple[list[Any], dict[str, int], LedgerState]:
    """A running ledger's fold (as `Ledger.maintain` forgets: evidence too, every few events) with the arrival
    lag and retention at `scale`: its releases and the findings it counted when found."""
    with mock.patch.object(upkeep_module, "ARRIVAL_LAG_S", ARRIVAL_LAG_S * scale):
        state = LedgerState()
    releases = []
    for n, event in enumerate(events, 1):
        release = state.apply(event)
        if release is not None:
            releases.append(release)
        if n % 8 == 0:
            state.forget_decided(event.ts - DEFAULT_DEFER_TIMEOUT_S * scale)
    return releases, dict(sorted(state.found_by_code.items())), state


def _answers(result: ReplayResult, events: list[Event], seed: int) -> dict[str, Any]:
    state = result.state
    return {
        "releases": result.releases,
        "found": dict(sorted(state.found_by_code.items())),
        "findings": [canonical(audit(state, now)) for now in audit_moments(events, random.Random(seed), count=4)],
    }


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([CENTURY, CROWDED]))
def test_decisions_and_findings_are_the_same_with_every_bound_default_small_and_off(seed: int, shape: Shape) -> None:
    note(f"history({seed}, {shape!r})")
    events = history(seed, shape)
    off = _replay(events, scale=None)
    default = _replay(events, scale=1.0)
    small = _replay(events, scale=0.01)
    assert off.state.tombstone_count == 0 and small.state.retire_queue is not None
    assert small.state.compacted_by_mode, "the history is long enough to compact"
    assert sum(small.state.compacted_by_phase.values()) > small.state.tombstone_count, "and to retire"
    assert off.state.past_window, "stamped ids were reused or late past their window"
    for result in (default, small):
        assert result.state.behind_horizon == 0 and compaction_warning(result.state) is None
    expected = _answers(off, events, seed)
    assert _answers(default, events, seed) == expected
    assert _answers(small, events, seed) == expected
    running, found, state = _running(events, scale=0.01)
    assert (running, found) == (expected["releases"], expected["found"])
    assert state.behind_horizon == 0 and len(state.tombstones) < sum(state.compacted_by_phase.values())
    # A snapshot mid-way (what a restart reads) carries the window's state: the fold goes on the same.
    half = len(events) // 2
    first = _replay(events[:half], scale=0.01)
    restored = snapshot.decode(snapshot.encode(first.state))
    assert [restored.apply(e) for e in events[half:]] == [first.state.apply(e) for e in events[half:]]


# -- rule S -------------------------------------------------------------------------------------------

ISSUED = 5000.0
P, C = "prefill-0/tp0", "decode-0/tp0"


def _decided(tid: str) -> tuple[Side, list[Event]]:
    p = Side(P, start_ts=ISSUED + 1.0)
    return p, [p.map(tid, "p-1", blocks=(1, 2)), p.ack(tid, "release")]


def _folded(events: list[Event], *, retire: bool) -> tuple[LedgerState, list[Any]]:
    """`events[:2]` folded, then (if `retire`) compacted and retired, then the rest: the releases after."""
    state, _ = fold_all(events[:2])
    if retire:
        state.forget_decided(ISSUED + 100.0)
        state.retire(ISSUED + ID_WINDOW_S + ARRIVAL_LAG_S + 1.0)
        assert state.tombstone_count == 0 and not state.transfers
    else:
        assert state.tombstone_count == 0 and state.transfers
    releases = [state.apply(e) for e in events[2:]]
    return state, releases


def test_a_map_past_the_window_is_refused_the_same_whether_the_side_is_held_or_retired() -> None:
    tid = stamped_id(ISSUED, 1)
    p, events = _decided(tid)
    past = ISSUED + ID_WINDOW_S + ARRIVAL_LAG_S + 5.0
    events.append(p.map(tid, "p-again", blocks=(3,), ts=past))
    held, held_releases = _folded(events, retire=False)
    retired, retired_releases = _folded(events, retire=True)
    assert held_releases == retired_releases == [None]
    assert not held.live and not retired.live and held.blocks_held == retired.blocks_held == 0
    found = canonical(audit(held, past + 1))
    assert found == canonical(audit(retired, past + 1))
    reuse = [f for f in audit(retired, past + 1) if f.code == "id_reuse"]
    assert len(reuse) == 1 and reuse[0].request_id == "p-again" and reuse[0].evidence == (3,)
    assert held.was_mapped((P, tid), past) and retired.was_mapped((P, tid), past)


def test_a_late_event_past_the_window_is_a_finding_the_same_whether_the_side_is_held_or_retired() -> None:
    tid = stamped_id(ISSUED, 2)
    p, events = _decided(tid)
    past = ISSUED + ID_WINDOW_S + ARRIVAL_LAG_S + 5.0
    events += [p.ack(tid, "release", rank=1, ts=past), p.expire(tid, ts=past + 1)]
    held, held_releases = _folded(events, retire=False)
    retired, retired_releases = _folded(events, retire=True)
    assert held_releases == retired_releases == [None, None]
    assert canonical(audit(held, past + 2)) == canonical(audit(retired, past + 2))
    late = [f for f in audit(retired, past + 2) if f.code == "late_event"]
    assert len(late) == 1 and late[0].evidence == (3, 4) and "window ended" in late[0].detail
    assert held.found_by_code == retired.found_by_code == {"late_event": 1}
    assert held.transfers[(P, tid)].late_seqs is None  # the held side itself was not touched


def test_inside_the_window_a_held_side_judges_as_before_and_a_live_one_is_never_retired() -> None:
    tid = stamped_id(ISSUED, 3)
    p = Side(P, start_ts=ISSUED + 1.0)
    state, _ = fold_all([p.map(tid, "p-1", blocks=(1,), deadline=ISSUED + 10 * ID_WINDOW_S)])
    state.forget_decided(ISSUED + 100.0)
    state.retire(ISSUED + 5 * ID_WINDOW_S)
    assert (P, tid) in state.live  # live: never compacted, never retired
    release = state.apply(p.ack(tid, "release", ts=ISSUED + 3 * ID_WINDOW_S))  # past the window, still live
    assert release is not None and release.cause == "completed" and not state.past_window
    other = stamped_id(ISSUED, 4)
    state.apply(p.map(other, "p-2", blocks=(2,), ts=ISSUED + 10.0))
    state.apply(p.ack(other, "release", ts=ISSUED + 11.0))
    state.apply(p.ack(other, "release", ts=ISSUED + ID_WINDOW_S - 1.0))  # inside: late, on the side
    assert state.transfers[(P, other)].late_seqs and not state.past_window


def test_an_unstamped_id_is_never_judged_by_time() -> None:
    p = Side(P, start_ts=ISSUED)
    state, _ = fold_all([p.map("tx-plain", "p-1", blocks=(1,)), p.ack("tx-plain", "release")])
    state.forget_decided(ISSUED + 100.0)
    state.retire(ISSUED + 100 * ID_WINDOW_S)
    assert (P, "tx-plain") in state.tombstones and state.unstamped_held == 1
    assert state.apply(p.map("tx-plain", "p-2", blocks=(5,), ts=ISSUED + 50 * ID_WINDOW_S)) is None
    assert state.transfers[(P, "tx-plain")].reuse_seqs == [3] and not state.past_window


def test_stamped_ids_round_trip_and_others_are_unstamped() -> None:
    tid = stamped_id(1_700_000_000.1234, 2**80 - 1)
    assert issued_at(tid) == 1_700_000_000.123 and tid.startswith("tx-") and tid[17] == "7" and tid[22] in "89ab"
    assert stamped_id(1.0, b"\x00" * 10) != stamped_id(1.0, b"\x00" * 9 + b"\x01")
    for other in ("tx-0003ae50", "", tid.upper(), tid[:-1] + "g", tid.replace("-7", "-4", 1), tid[3:]):
        assert issued_at(other) is None, other
    with pytest.raises(ValueError, match="now_s"):
        stamped_id(-1.0, 0)
    with pytest.raises(ValueError, match="now_s"):
        stamped_id(math.nan, 0)


# -- memory --------------------------------------------------------------------------------------------


def test_held_tombstones_of_stamped_ids_stay_below_rate_times_window_and_lag() -> None:
    every_s = 5.0
    p, c = Side(P, start_ts=ISSUED), Side(C, start_ts=ISSUED)
    transfers = int(20 * (ID_WINDOW_S + ARRIVAL_LAG_S) / every_s)  # twenty windows and lags long

    def events() -> Any:
        for i in range(transfers):
            start = ISSUED + i * every_s
            tid = stamped_id(start, i)
            yield p.map(tid, f"p-{i}", blocks=(i % 64,), ts=start)
            yield c.map(tid, f"c-{i}", "consumer", blocks=(i % 64,), ts=start + 0.5)
            yield c.ack(tid, "read", ts=start + 1.0)
            yield p.ack(tid, "release", ts=start + 1.5)

    held_max = 0

    def watch(_: int) -> None:
        nonlocal held_max
        held_max = max(held_max, result_state[0].tombstone_count + len(result_state[0].transfers))

    result_state: list[LedgerState] = []
    original = replay_module.LedgerState

    def remembered() -> LedgerState:
        state = original()
        result_state.append(state)
        return state

    with mock.patch.object(replay_module, "LedgerState", remembered):
        result = replay_chunks(batched(events(), 64), compact_every=64, on_progress=watch)
    sides_per_s = 2 / every_s
    bound = sides_per_s * (ID_WINDOW_S + ARRIVAL_LAG_S + REPLAY_RETAIN_S) + 2 * 64  # plus a chunk and a cadence
    assert result.release_count == 2 * transfers
    assert 0 < held_max <= bound, (held_max, bound)
    assert result.state.tombstone_count <= bound and result.state.unstamped_held == 0
    assert sum(result.state.compacted_by_phase.values()) > 10 * bound  # most were retired


# -- the 4M-event log --------------------------------------------------------------------------------------

CASE = json.loads((Path(__file__).parents[1] / "data" / "four_million_events.json").read_text())


def _case(stamped: bool) -> tuple[SynthConfig, int, str]:
    cfg = SynthConfig(**CASE["settings"], stamped=stamped)
    return cfg, CASE["seed"], CASE["source"]


OLD_TOMBSTONES_MAX = 100_000
"""The count bound that tombstones had, past which a Bloom filter answered for evicted ids."""


@pytest.mark.parametrize("stamped", [False, True])
def test_a_fresh_write_producer_after_more_transfers_than_the_old_bound_held_completes(stamped: bool) -> None:
    """The 4M-event log's condition, small: a fresh WRITE producer on prefill-0/tp0 after more transfers were
    compacted than the old tombstone bound held (then only the filter answered, and could refuse it)."""
    p = Side(CASE["source"], start_ts=ISSUED, step_s=0.01)  # a replay compacts what was decided 60 s before
    traffic = OLD_TOMBSTONES_MAX * 11 // 10

    def events() -> Any:
        for i in range(traffic):
            tid = stamped_id(p.ts, i) if stamped else f"tx-{i:08x}"
            yield p.map(tid, f"p-{i}", blocks=(i % 512,))
            yield p.ack(tid, "release")
        tid = stamped_id(p.ts, traffic) if stamped else CASE["transfer_id"]
        yield p.map(tid, "p-fresh", "producer", "write", blocks=(600, 601))
        for layers in ((0, 1), (2, 3)):
            yield p.schedule(tid, layers, op="write")
            yield p.ack(tid, "write", layers)
        yield p.seal(tid, 4)

    result = replay_chunks(batched(events(), 4096), keep_releases=True)
    last = result.releases[-1]
    assert (last.source, last.role, last.mode, last.cause) == (CASE["source"], "producer", "write", "completed")
    assert result.release_count == traffic + 1 and result.state.behind_horizon == 0
    assert sum(result.state.compacted_by_phase.values()) > OLD_TOMBSTONES_MAX


@pytest.mark.slow
@pytest.mark.huge
@pytest.mark.parametrize("stamped", [False, True])
def test_the_four_million_event_log_completes_its_fresh_transfer(stamped: bool) -> None:
    cfg = SynthConfig(**CASE["settings"], stamped=stamped)
    number = int(CASE["transfer_number"])
    events = generate(cfg, seed=CASE["seed"])
    chunks = iter(lambda: list(itertools.islice(events, 100_000)), [])
    result = replay_chunks(chunks, keep_releases=False)
    state = result.state
    assert result.events == CASE["events"]
    # Transfer `number`'s id ends in its number, stamped (the random bits) or not.
    ids = [tid for source, tid in itertools.chain(state.transfers, state.tombstones) if source == CASE["source"]]
    ours = [tid for tid in ids if tid.endswith(f"{number:08x}")]
    assert len(ours) == 1
    side = state.side((CASE["source"], ours[0]))
    assert side is not None and side.role == "producer" and side.mode == "write"
    assert side.decision is not None and side.decision.cause == "completed"
    assert not state.past_window.get((CASE["source"], ours[0]))
    assert state.behind_horizon == 0 and compaction_warning(state) is None
    if stamped:
        assert state.unstamped_held == 0 and issued_at(ours[0]) is not None
    else:
        assert ours[0] == CASE["transfer_id"] == synth_transfer_id(cfg, number, 0.0)
