"""Each fault kind alone, at a high rate, in both modes: the invariants hold and the fault leaves its mark."""

from __future__ import annotations

import pytest

from kvledger.connector.sim.check import evaluate
from kvledger.connector.sim.config import FAULT_KINDS, FaultKind, StormConfig
from kvledger.connector.sim.driver import Storm
from kvledger.ledger.events import Mode

SEED = 11
REQUESTS = 300
CONCURRENCY = 64
RATE = 0.2


def _reasons(storm: Storm) -> list[str]:
    return [r.reason for e in storm.engines for rel in e.releases.values() for r in rel]


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_one_fault_kind(kind: FaultKind, mode: Mode) -> None:
    config = StormConfig(
        seed=SEED, mode=mode, requests=REQUESTS, concurrency=CONCURRENCY, faults=frozenset({kind}), fault_rate=RATE
    )
    storm = Storm(config)
    result = evaluate(storm, storm.run())
    assert result.problems == [], result.problems
    assert result.faults_injected.get(kind, 0) > 0
    reasons = _reasons(storm)
    if kind == "sq_full":
        transient = sum(t.transient_failures for e in storm.engines for t in e.worker.ledger.state.transfers.values())
        assert transient > 0
        assert any("transient_failures_past_transfer_timeout" in r for r in reasons)  # endless bursts give up
    elif kind == "transfer_fail":
        assert result.failed_recving == result.faults_injected[kind]
    elif kind in ("drop", "never_ready"):
        assert any("deadline passed" in r for r in reasons)
        assert result.naive_hung_requests > 0
    elif kind in ("duplicate", "late"):
        assert result.findings.get("late_event", 0) > 0
    elif kind == "early" and mode == "read":
        # The read reaches the producer worker before it maps the transfer: "not held yet" (transient), so the
        # consumer retries until it is, and no release can beat the map any more.
        not_yet = [
            e
            for evs in storm.consumer.events.values()
            for e in evs
            if getattr(e, "retryable", False) and "NOT_HELD_YET" in getattr(e, "reason", "")
        ]
        assert not_yet and result.hung_requests == 0
    elif kind == "late_reader":
        assert result.late_reads > 0 and result.lease_renewals > 0
        assert result.corrupt_receives == 0 and result.premature_releases == 0
    elif kind == "peer_death":
        assert result.lost_requests > 0
    elif kind == "forged_release":
        # Every forged release was dropped and shows in the audit; none freed a producer early.
        assert result.forged_sent == result.faults_injected[kind] == result.findings["forged_message"]
        assert result.forged_messages_accepted == 0 and result.premature_releases == 0
    elif kind == "silent_peer":
        # Its requests held slots until their transfers were decided (then given up): none starved another.
        assert result.silent_requests > 0 and result.failed_recving == result.faults_injected[kind]
        assert result.starved_transfers == 0 and result.inflight_leaked == 0
    if kind in ("sq_full", "transfer_fail", "drop", "never_ready", "peer_death"):
        assert result.naive_leaked_blocks > 0


def test_without_faults_nothing_is_found_and_naive_agrees() -> None:
    for mode in ("read", "write"):
        storm = Storm(StormConfig(seed=SEED, mode=mode, requests=REQUESTS, concurrency=CONCURRENCY, faults=frozenset()))
        result = evaluate(storm, storm.run())
        assert result.problems == [] and result.findings == {}
        assert result.integrity_checked == REQUESTS and result.failed_recving == 0
        # The naive rules are right on the happy path: what they strand under faults is the faults' doing.
        assert result.naive_leaked_blocks == 0 and result.naive_hung_requests == 0 and result.naive_dropped_acks == 0


def test_the_older_worker_call_order_holds_too() -> None:
    for mode in ("read", "write"):
        storm = Storm(
            StormConfig(
                seed=SEED, mode=mode, requests=REQUESTS, concurrency=CONCURRENCY, start_load_before_forward=True
            )
        )
        result = evaluate(storm, storm.run())
        assert result.problems == [], result.problems
