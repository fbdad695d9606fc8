"""Rule S's record of events past a stamped id's window (ledger/upkeep.py, `_past_window`): every such event
counted, the first `EVIDENCE_SEQS_MAX` of each kind kept as the finding's evidence, and its source known to
the state like any other (a source whose events all came past their window is still judged, listed and
snapshotted)."""

from __future__ import annotations

from kvledger.ledger.audit import audit
from kvledger.ledger.fold import fold_all
from kvledger.ledger.humanize import utc
from kvledger.ledger.ids import stamped_id
from kvledger.ledger.limits import EVIDENCE_SEQS_MAX, ID_WINDOW_S
from tests.ledger.builders import Side

ISSUED = 5000.0
PAST = ISSUED + ID_WINDOW_S + 1.0
EXTRA = 3


def test_a_source_whose_events_all_came_past_their_window_is_one_of_the_states_sources() -> None:
    tid = stamped_id(ISSUED, 1)
    late, mapped = Side("decode-9/tp0", start_ts=PAST), Side("prefill-9/tp0", start_ts=PAST)
    state, releases = fold_all([late.ack(tid, "recv"), mapped.map(tid, "p-1")])
    assert releases == [] and not state.transfers  # judged alone: no side opened
    assert list(state.sources) == ["decode-9/tp0", "prefill-9/tp0"]


def test_every_map_past_the_window_is_counted_and_the_first_ones_are_the_evidence() -> None:
    tid = stamped_id(ISSUED, 2)
    p = Side("prefill-0/tp0", start_ts=PAST)
    maps = EVIDENCE_SEQS_MAX + EXTRA
    state, _ = fold_all([p.map(tid, "p-1", blocks=(i,)) for i in range(maps)])
    (reuse,) = audit(state, PAST + 10.0)
    assert reuse.code == "id_reuse"
    assert reuse.evidence == tuple(range(1, EVIDENCE_SEQS_MAX + 1))
    window_ended = utc(ISSUED + ID_WINDOW_S)
    assert reuse.detail == f"transfer id mapped {maps} times after its id window ended ({window_ended}): refused"
    assert reuse.block_ids == (0,)  # the first refused map's


def test_every_late_event_past_the_window_is_counted_and_the_first_ones_are_the_evidence() -> None:
    tid = stamped_id(ISSUED, 3)
    c = Side("decode-0/tp0", start_ts=PAST)
    late = EVIDENCE_SEQS_MAX + EXTRA
    state, _ = fold_all([c.ack(tid, "recv") for _ in range(late)])
    (finding,) = audit(state, PAST + 10.0)
    assert finding.code == "late_event"
    assert finding.evidence == tuple(range(1, EVIDENCE_SEQS_MAX + 1))
    window_ended = utc(ISSUED + ID_WINDOW_S)
    assert finding.detail == f"{late} events after the transfer id's window ended ({window_ended}): judged alone"
