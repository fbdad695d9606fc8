"""Compaction cannot change a decision or a finding (issue 12, item 3), over long generated histories:
many retention windows (REPLAY_RETAIN_S) of log time, both sides, every event kind, expires, late and
duplicate events, ids reused before and after the decision and after compaction.

- a replay with compaction decides and finds exactly what a replay without it does, also with a small
  tombstone bound that is not hit; when it is hit, it is counted and the replay warns;
- a running ledger that forgets decided sides often decides exactly what one that never forgets does,
  and answers `was_mapped` the same;
- a snapshot taken mid-history continues exactly as the state it was taken of.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import kvledger.ledger.upkeep as upkeep_module
from kvledger.cli.replay import report_compaction
from kvledger.ledger.audit import audit
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.limits import MAINTENANCE_INTERVAL_S, REPLAY_RETAIN_S
from kvledger.ledger.merge import batched
from kvledger.ledger.replay import ReplayResult, replay_chunks
from kvledger.ledger.side import due_at
from kvledger.ledger.store import snapshot
from kvledger.ledger.summary import compaction_report, compaction_warning, summarize
from tests.ledger.histories import Shape, audit_moments, history
from tests.ledger.reference import Reference, canonical

LONG = Shape(
    transfers=300, span_s=15 * REPLAY_RETAIN_S, late_gap_s=4 * REPLAY_RETAIN_S, faults_per_side=0.3,
    reuse_rate=0.05, premature_rate=0.15, block_pool=64, overfull_rate=0.03,
)  # fmt: skip
"""Fifteen retention windows; mostly clean sides (a replay compacts those), late events and reused ids
arriving up to four windows after the side's decision, so after its compaction."""
LONG_UNKIND = Shape(
    transfers=200, span_s=10 * REPLAY_RETAIN_S, late_gap_s=3 * REPLAY_RETAIN_S, faults_per_side=1.5,
    reuse_rate=0.2, orphan_rate=0.1, premature_rate=0.3, block_pool=16,
    consumers=("decode-0/tp0", "decode-1/tp0"),
)  # fmt: skip
"""Every fault kind, often: most sides carry evidence and stay whole in a replay."""

SEEDS = st.integers(0, 2**32 - 1)
LONG_SHAPES = st.sampled_from([LONG, LONG, LONG_UNKIND])
PROPERTY = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _same_findings(a: LedgerState, b: LedgerState, events: list[Event], seed: int) -> None:
    for now in audit_moments(events, random.Random(seed), count=4):
        assert canonical(audit(a, now)) == canonical(audit(b, now)), now


def _counts(state: LedgerState) -> dict[str, object]:
    """What a summary counts: sides by phase and mode (compacted ones included), releases, held blocks."""
    summary = summarize(state, [])
    return {k: v for k, v in summary.items() if k not in ("compaction", "findings_by_code", "findings_by_severity")}


def _replay(events: list[Event], chunk: int, compact_every: int | None) -> ReplayResult:
    return replay_chunks(batched(events, chunk), compact_every=compact_every)


@PROPERTY
@given(seed=SEEDS, shape=LONG_SHAPES, chunk=st.sampled_from([1, 7, 64]), every=st.sampled_from([1, 16, 300]))
def test_a_replay_with_compaction_decides_and_finds_what_one_without_does(
    seed: int, shape: Shape, chunk: int, every: int
) -> None:
    note(f"history({seed}, {shape!r})")
    events = history(seed, shape)
    whole = _replay(events, chunk, None)
    compacted = _replay(events, chunk, every)
    assert whole.state.tombstone_count == 0
    assert compacted.state.tombstone_count > 0, "the history is long enough to compact"
    assert compacted.state.tombstones_evicted == 0 and compaction_warning(compacted.state) is None
    assert compacted.releases == whole.releases
    assert _counts(compacted.state) == _counts(whole.state)
    _same_findings(compacted.state, whole.state, events, seed)
    # And both are what the reference, which never forgets anything, finds.
    reference = Reference(events)
    assert whole.releases == reference.releases
    now = events[-1].ts + 1.0
    assert canonical(audit(compacted.state, now)) == canonical(reference.findings(now))


def _forgets(events: list[Event]) -> int:
    """How many sides a replay compacting after every event turns into tombstones (with repeats)."""
    state = _replay(events, 1, 1).state
    return state.id_memory.added if state.id_memory is not None else 0


@PROPERTY
@given(seed=SEEDS)
def test_a_small_tombstone_bound_that_is_not_hit_changes_nothing(seed: int) -> None:
    note(f"history({seed}, {LONG!r})")
    events = history(seed, LONG)
    forgets = _forgets(events)
    bound = 2 * (forgets // 2 + 1)  # one generation turns over, the second never fills
    whole = _replay(events, 1, None)
    with mock.patch.object(upkeep_module, "TOMBSTONES_MAX", bound):
        small = _replay(events, 1, 1)
    assert small.state.tombstones_max == bound and small.state.tombstones_old, "a generation turned over"
    assert small.state.tombstones_evicted == 0 and compaction_warning(small.state) is None
    assert small.releases == whole.releases
    _same_findings(small.state, whole.state, events, seed)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_tombstone_bound_that_is_hit_is_counted_and_the_replay_warns(
    seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    events = history(seed, LONG)
    whole = _replay(events, 1, None)
    with mock.patch.object(upkeep_module, "TOMBSTONES_MAX", 8):
        hit = _replay(events, 1, 1)
    state = hit.state
    assert state.tombstones_evicted > 0 and state.tombstone_count <= 8
    assert compaction_report(state)["tombstones_evicted"] == state.tombstones_evicted
    warning = compaction_warning(state)
    evicted = f"{state.tombstones_evicted} compacted transfer sides evicted past 8 tombstones"
    assert warning is not None and evicted in warning
    report_compaction(compaction_warning(hit.state))
    assert f"kvledger: warning: {warning}" in capsys.readouterr().err
    # Past the bound findings may be lost (counted), decisions are not: the id memory refuses reused ids.
    assert hit.releases == whole.releases
    assert state.late_after_eviction + state.reused_after_eviction > 0


def _by_source(events: list[Event]) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = {}
    for e in events:
        out.setdefault(e.source, []).append(e)
    return out


@PROPERTY
@given(
    seed=SEEDS,
    shape=LONG_SHAPES,
    retain_s=st.sampled_from([0.0, 1.0, 5.0, 20.0]),
    every=st.sampled_from([1, 3, 50]),
)
def test_a_running_ledger_that_forgets_decides_what_one_that_never_forgets_does(
    seed: int, shape: Shape, retain_s: float, every: int
) -> None:
    note(f"history({seed}, {shape!r})")
    for source, events in _by_source(history(seed, shape)).items():
        keeping = Ledger(source)
        forgetting = Ledger(source)
        maintained = Ledger(source)
        keys = {(e.source, e.transfer_id) for e in events}
        forgot = 0
        for n, event in enumerate(events, 1):
            keeping.append(event)
            forgetting.append(event)
            maintained.append(event)
            if n % every == 0:
                forgot += forgetting.state.forget_decided(event.ts - retain_s)
            maintained.maintain(event.ts, retain_s=retain_s)  # rate-limited by MAINTENANCE_INTERVAL_S
            if n % 97 == 0:
                for key in keys:
                    assert forgetting.state.was_mapped(key) == keeping.state.was_mapped(key), key
        assert forgot > 0 and forgetting.state.tombstones_evicted == 0
        expected: list[Release] = keeping.take_releases()
        assert forgetting.take_releases() == expected
        assert maintained.take_releases() == expected
        for key in keys:
            assert forgetting.state.was_mapped(key) == maintained.state.was_mapped(key) == keeping.state.was_mapped(key)
        assert events[-1].ts - events[0].ts > 4 * MAINTENANCE_INTERVAL_S


def _current_deadlines(state: LedgerState) -> list[tuple[tuple[object, ...], bool]]:
    return [(d[:4], due_at(d[4]) == d[0]) for d in state.deadlines]


@PROPERTY
@given(seed=SEEDS, shape=LONG_SHAPES, cut=st.floats(0.1, 0.9), keep_evidence=st.booleans())
def test_a_snapshot_taken_mid_history_continues_as_the_state_does(
    seed: int, shape: Shape, cut: float, keep_evidence: bool
) -> None:
    note(f"history({seed}, {shape!r})")
    events = history(seed, shape)
    head, tail = events[: int(len(events) * cut)], events[int(len(events) * cut) :]
    state, _ = fold_all(head)
    state.forget_decided(head[-1].ts - REPLAY_RETAIN_S / 4, keep_evidence=keep_evidence)
    assert state.tombstone_count > 0
    restored = snapshot.decode(snapshot.encode(state))
    assert snapshot.encode(restored) == snapshot.encode(state)
    # Each deadline entry comes back with its side (written without it): current where it was, stale where it was.
    assert _current_deadlines(restored) == _current_deadlines(state)
    assert [restored.apply(e) for e in tail] == [state.apply(e) for e in tail]
    _same_findings(restored, state, events, seed)
    assert snapshot.encode(restored) == snapshot.encode(state)
    assert snapshot.encode(snapshot.decode(snapshot.encode(state))) == snapshot.encode(state)  # recalled sides too


@PROPERTY
@given(seed=SEEDS, shape=LONG_SHAPES, cut=st.floats(0.1, 0.9), forget=st.booleans())
def test_a_snapshot_taken_is_the_state_as_it_was_however_the_fold_goes_on_before_it_is_encoded(
    seed: int, shape: Shape, cut: float, forget: bool
) -> None:
    """The service copies the state where the fold cannot move (`snapshot.take`) and encodes the copy while
    it goes on: the bytes are those of the state when it was taken, whatever the fold (and compaction)
    changed since, in place or not: late seqs appended to decided sides, heaps pushed, claims moved."""
    note(f"history({seed}, {shape!r})")
    events = history(seed, shape)
    head, tail = events[: int(len(events) * cut)], events[int(len(events) * cut) :]
    state, _ = fold_all(head)
    expected = snapshot.encode(state)
    taken = snapshot.take(state)
    late = {key: list(t.late_seqs or ()) for key, t in state.transfers.items()}
    for event in tail:
        state.apply(event)
    if forget:
        state.forget_decided(tail[-1].ts - REPLAY_RETAIN_S, keep_evidence=True)
    assert snapshot.encode(state) != expected  # the fold did go on
    assert snapshot.encode_taken(taken) == expected
    grown = [k for k, t in state.transfers.items() if k in late and list(t.late_seqs or ()) != late[k]]
    note(f"{len(grown)} sides taken had late seqs appended after")
