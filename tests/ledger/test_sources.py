"""Lost sources: silent for three transfer timeouts while holding blocks, or known dead; never a live writer."""

from __future__ import annotations

from kvledger.ledger.fold import LedgerState
from kvledger.ledger.limits import LOST_SILENCE_TRANSFER_TIMEOUTS
from kvledger.ledger.sources import engine_of, judge_sources
from tests.ledger.builders import Side

TIMEOUT_S = 30.0


def state_of(*sides_events: list) -> tuple[LedgerState, dict[str, float]]:  # type: ignore[type-arg]
    state, last_ts = LedgerState(), {}
    for events in sides_events:
        for event in events:
            state.apply(event)
            last_ts[event.source] = max(last_ts.get(event.source, 0.0), event.ts)
    return state, last_ts


def test_silence_past_the_limit_while_holding_is_lost_and_not_before() -> None:
    holder, idle = Side("prefill-0/tp0", start_ts=0.0), Side("decode-0/tp0", start_ts=0.0)
    state, last = state_of([holder.map("tx-1", "r-1", blocks=(1, 2))],
                           [idle.map("tx-2", "r-2"), idle.ack("tx-2", "release")])  # fmt: skip
    limit_s = LOST_SILENCE_TRANSFER_TIMEOUTS * TIMEOUT_S
    before = judge_sources(state, last, 0.01 + limit_s - 1, transfer_timeout_s=TIMEOUT_S)
    after = judge_sources(state, last, 0.01 + limit_s + 1, transfer_timeout_s=TIMEOUT_S)
    assert not before["prefill-0/tp0"].lost and after["prefill-0/tp0"].lost
    assert "silent for 1 min 31 s while holding blocks" in after["prefill-0/tp0"].why
    assert (after["prefill-0/tp0"].sides_held, after["prefill-0/tp0"].blocks_held) == (1, 2)
    # Just as silent, but holding nothing: an idle engine is not a lost one.
    assert not after["decode-0/tp0"].lost and after["decode-0/tp0"].sides_held == 0


def test_a_known_dead_engine_is_lost_whatever_its_log_says() -> None:
    side = Side("prefill-3/tp1", start_ts=0.0)
    state, last = state_of([side.map("tx-1", "r-1")])
    health = judge_sources(state, last, 0.02, transfer_timeout_s=TIMEOUT_S, dead={"prefill-3": "node drained"})
    assert health["prefill-3/tp1"].lost and health["prefill-3/tp1"].why == "known dead: node drained"
    assert health["prefill-3/tp1"].silent_s < 0.1
    assert engine_of("prefill-3/tp1") == "prefill-3" and engine_of("solo") == "solo"
