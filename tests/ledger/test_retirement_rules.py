"""What compaction and retirement leave an audit (ledger/upkeep.py): a compacted never-mapped side reads as
it was, retirement counts every tombstone and orphan it lets go of, it keeps only the tombstones a merged
audit's premature_release still reads, and a side rebuilt from its tombstone has its life's times."""

from __future__ import annotations

from kvledger.ledger.audit import audit, found_at
from kvledger.ledger.decisions import Key
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.ids import stamped_id
from kvledger.ledger.limits import ARRIVAL_LAG_S, ID_WINDOW_S
from tests.ledger.builders import Side

ISSUED = 5000.0
COMPACT_BEFORE = ISSUED + 100.0
"""After every side below was decided, long before any id window ended."""
RETIRE_AT = ISSUED + ID_WINDOW_S + ARRIVAL_LAG_S + 1.0
P, C = "prefill-0/tp0", "decode-0/tp0"


def _sides() -> tuple[LedgerState, Key, Key, Key]:
    """A producer released by expire whose consumer read later (a premature pair), a completed producer, and
    a never-mapped side that expired: all stamped, all decided by ISSUED + 10."""
    expired, completed, orphan = (stamped_id(ISSUED, i) for i in (1, 2, 3))
    p, c = Side(P, start_ts=ISSUED + 1.0), Side(C, start_ts=ISSUED + 1.0)
    events: list[Event] = [
        p.map(expired, "p-1", blocks=(1,), ts=ISSUED + 1.0),
        c.map(expired, "c-1", "consumer", blocks=(5,), remote=(1,), ts=ISSUED + 1.0),
        p.expire(expired, ts=ISSUED + 2.0),
        c.ack(expired, "read", ts=ISSUED + 8.0),  # six seconds after its producer let go
        p.map(completed, "p-2", blocks=(2,), ts=ISSUED + 3.0),
        p.ack(completed, "release", ts=ISSUED + 4.0),
        c.ack(orphan, "recv", ts=ISSUED + 5.0),
        c.expire(orphan, ts=ISSUED + 6.0),
    ]
    state, _ = fold_all(events)
    return state, (P, expired), (P, completed), (C, orphan)


def test_a_compacted_never_mapped_side_reads_as_it_was() -> None:
    state, _, _, orphan = _sides()
    before = state.side(orphan)
    assert before is not None and before.role is None and before.events == 2
    state.forget_decided(COMPACT_BEFORE)
    assert orphan not in state.transfers and orphan in state.orphan_tombstones
    assert state.side(orphan) is before


def test_retirement_counts_every_tombstone_and_orphan_it_lets_go_of() -> None:
    state, _, completed, orphan = _sides()
    assert state.forget_decided(COMPACT_BEFORE) == 4  # both sides of the premature pair, the completed, the orphan
    assert state.tombstone_count == 4
    assert state.retire(RETIRE_AT) == 4
    assert state.tombstone_count == 0 and not state.orphan_tombstones
    assert state.side(orphan) is None and state.side(completed) is None


def test_retirement_keeps_only_the_tombstones_a_premature_release_reads() -> None:
    state, expired, completed, _ = _sides()
    state.forget_decided(COMPACT_BEFORE)
    state.retire(RETIRE_AT)
    consumer: Key = (C, expired[1])
    assert set(state.settled) == {expired, consumer}
    assert state.side(completed) is None
    (premature,) = [f for f in audit(state, RETIRE_AT) if f.code == "premature_release"]
    assert premature.transfer_id == expired[1]
    assert premature.evidence == (2, 2)  # the expire (its seq in P's log), the read (in C's)


def test_a_finding_of_a_compacted_side_is_found_within_its_life() -> None:
    state, expired, _, _ = _sides()
    (whole,) = [f for f in audit(state, COMPACT_BEFORE) if f.code == "premature_release"]
    assert found_at(whole, state) == ISSUED + 2.0  # its last event, the expire
    state.forget_decided(COMPACT_BEFORE)
    assert expired in state.tombstones
    (compacted,) = [f for f in audit(state, COMPACT_BEFORE) if f.code == "premature_release"]
    assert compacted == whole
    assert ISSUED + 1.0 <= found_at(compacted, state) <= ISSUED + 2.0  # between its map and its decision
    rebuilt = state.side(expired)
    assert rebuilt is not None and rebuilt.last_seq == 1 and rebuilt.last_ts == ISSUED + 1.0  # its map, kept
