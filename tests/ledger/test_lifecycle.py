"""The lifecycle table drives every phase change (issue 15, item 2), and the one completion rule is the
one every reader uses.

Over generated histories (faults, reused ids, early and late events, orphans), each event's phase
change on its side is checked against `TRANSITIONS`: a side moves only along the table's rows (a map
also replays the schedules and seal the side gathered unmapped, in the table's order), and an event
for a side already in a terminal phase changes nothing but the evidence.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.ledger.events import Event, Map
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.lifecycle import NEXT_PHASE, TERMINAL, TRANSITIONS, Phase, PhaseName
from kvledger.ledger.side import TransferState, completed_by, is_complete
from tests.ledger.histories import Shape, history
from tests.ledger.reference import _complete, judge

SEEDS = st.integers(0, 2**32 - 1)
SHAPES = st.builds(Shape, transfers=st.integers(1, 40))


def _reachable(start: PhaseName, kind: str, decision: str | None) -> set[PhaseName]:
    """Phases the table allows after `kind` from `start`: its row, then (for a map) the catch-up rows,
    then the decision row when the event decided."""
    after = {TRANSITIONS[(start, kind)]}
    if kind == "map":
        for trigger in ("schedule", "seal"):
            after |= {NEXT_PHASE[trigger][p] for p in after if p in NEXT_PHASE[trigger]}
    if decision is not None:
        after = {TRANSITIONS[(p, decision)] for p in after if (p, decision) in TRANSITIONS}
    return after


def _evidence(t: TransferState) -> int:
    return sum(len(x or ()) for x in (t.late_seqs, t.duplicate_seqs, t.over_ack_seqs, t.reuse_seqs))


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, shape=SHAPES)
def test_every_phase_change_is_a_row_of_the_table(seed: int, shape: Shape) -> None:
    state = LedgerState()
    moves = 0
    for event in history(seed, shape):
        key = (event.source, event.transfer_id)
        before = state.transfers.get(key)
        phase: PhaseName = before.phase if before is not None else Phase.UNMAPPED
        evidence = _evidence(before) if before is not None else 0
        was_mapped = before is not None and before.role is not None
        release = state.apply(event)
        after = state.transfers.get(key)
        if after is None:
            continue  # a side already compacted and evicted: counted, not folded (none here)
        kind = event.__struct_config__.tag
        assert isinstance(kind, str)
        if phase in TERMINAL:
            reopened = isinstance(event, Map) and not was_mapped
            if not reopened:
                # No row: the phase stays, the event is evidence (an orphan's second expire excepted).
                assert after.phase == phase, (event, phase, after.phase)
                assert release is None
                continue
            phase = Phase.UNMAPPED  # the named reopen path: mapped, then decided at once
            assert release is not None
        decision = release.cause if release is not None else None
        if after.phase == phase and _evidence(after) > evidence and release is None:
            continue  # an event that is only evidence (a layer no model has, a refused map): no phase change
        assert after.phase in _reachable(phase, kind, decision), (event, phase, after.phase, decision)
        moves += after.phase != phase
    assert moves > 0 or not state.transfers


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, shape=SHAPES)
def test_events_after_a_decision_are_evidence_and_change_nothing_else(seed: int, shape: Shape) -> None:
    state = LedgerState()
    for event in history(seed, shape):
        t = state.transfers.get((event.source, event.transfer_id))
        if t is None or not t.closed or t.role is None:
            state.apply(event)
            continue
        decision, phase, before = t.decision, t.phase, _evidence(t)
        assert state.apply(event) is None
        assert t.decision is decision and t.phase == phase
        assert _evidence(t) == before + 1 or _evidence(t) == before  # bounded evidence lists stop growing


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, shape=SHAPES)
def test_the_one_completion_rule_agrees_with_the_reference(seed: int, shape: Shape) -> None:
    events = history(seed, shape)
    state = LedgerState()
    by_key: dict[tuple[str, str], list[Event]] = {}
    for event in events:
        state.apply(event)
        by_key.setdefault((event.source, event.transfer_id), []).append(event)
    checked = 0
    for key, side in state.transfers.items():
        verdict = judge(key, by_key[key])  # type: ignore[arg-type]
        if verdict.mapped is None:
            continue
        assert is_complete(side) == _complete(verdict), key
        if side.decision is not None and side.decision.cause == "completed":
            assert completed_by(side) is not None and side.decision.why == "completed"
        checked += 1
    assert checked > 0
