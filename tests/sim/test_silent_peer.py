"""The storm's silent_peer fault (issue 36): transfers whose transport requests go to a peer that takes them and
never answers. With the protections (a bound per peer on the tcp transport's in-flight requests, and the worker
giving a decided transfer's requests up) every other transfer is served and every slot comes back; the negative
control (the transport and worker as they were: one bound over all peers, no deadline, nothing given up) starves:
the silent peer's requests keep the slots, and transfers no fault touched fail for want of one."""

from __future__ import annotations

import pytest

from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.storm import run_storm
from kvledger.ledger.events import Mode

SMALL = dict(
    seed=11, requests=300, concurrency=64, faults=frozenset({"silent_peer"}), fault_rate=0.2, transport_inflight_max=64
)
"""Sixty-odd silent transfers, two layers each: more requests than the 64 slots, which the negative control never
gets back; with protections the silent peer may hold 16 of them (a quarter), and the live peer has 16 of its own,
more than one round's requests need once the first ones are answered."""


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_silent_peer_starves_nothing_and_every_slot_comes_back(mode: Mode) -> None:
    r = run_storm(StormConfig(mode=mode, **SMALL))  # type: ignore[arg-type]
    assert r.problems == [], r.problems
    silent = r.faults_injected["silent_peer"]
    assert silent > 0 and r.silent_requests > 0
    assert r.starved_transfers == 0 and r.inflight_leaked == 0
    # Each silent transfer fails (a load error, never a receive of bytes that never came); every other one is served.
    assert r.failed_recving == silent and r.corrupt_receives == 0
    assert r.finished_recving == r.requests


@pytest.mark.parametrize("mode", ["read", "write"])
def test_negative_control_without_the_protections_the_silent_peer_starves_the_rest(mode: Mode) -> None:
    r = run_storm(StormConfig(mode=mode, protections=False, **SMALL))  # type: ignore[arg-type]
    assert r.inflight_leaked == SMALL["transport_inflight_max"], "the silent peer's slots came back"
    assert r.starved_transfers > 0, "no transfer was refused a slot: the control shows nothing"
    assert r.failed_recving > r.faults_injected["silent_peer"]
    assert any("in-flight slots held for others" in p for p in r.problems), r.problems
    assert any("in-flight slots never came back" in p for p in r.problems), r.problems
