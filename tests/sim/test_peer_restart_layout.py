"""The peer_restart_layout fault: the engine whose KV the other moves (READ: the producer; WRITE: the consumer)
dies mid-run and comes back on the same ports with twice the blocks, so every V run of its KV cache lies
elsewhere. With generations, the other engine handshakes again before it moves a byte of the new life and no
receive is wrong; the negative control (engines that name no generation, the connector as it was) moves the
new life's KV with the old layout and reports the wrong bytes as received."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.connector.reasons import REASON_ENGINE_RESTARTED
from kvledger.connector.sim import StormConfig, run_storm
from kvledger.ledger.events import Fail, Mode
from kvledger.ledger.store.connect import open_store

SMALL = dict(seed=5, requests=300, concurrency=64, faults=frozenset({"peer_restart_layout"}))


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_restarted_peer_is_never_moved_with_its_old_layout(mode: Mode) -> None:
    r = run_storm(StormConfig(mode=mode, **SMALL))
    assert r.ok, r.problems
    assert r.faults_injected == {"peer_restart_layout": 1} and r.lost_requests > 0
    assert r.stale_links >= 1  # a transfer of the new life found the old link and handshook again first
    assert r.corrupt_receives == 0
    assert r.integrity_checked > r.requests // 3  # receives after the restart were checked, not only before


@pytest.mark.parametrize("mode", ["read", "write"])
def test_the_negative_control_moves_the_new_life_with_the_old_layout(mode: Mode) -> None:
    r = run_storm(StormConfig(mode=mode, protections=False, **SMALL))
    assert r.faults_injected == {"peer_restart_layout": 1}
    assert r.stale_links == 0
    assert r.corrupt_receives > 0 and not r.ok


def test_a_restart_fails_what_its_previous_process_held_on_the_storm_clock(tmp_path: Path) -> None:
    """The restarted engine's ledgers reopen from the store and fail what the previous process held, stamped
    by the simulated clock every other event carries: on the wall clock (years from the storm's start) the
    failures sat after the new life's events, and a source's last level in the page's plot read 0."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    config = StormConfig(mode="read", ledger_url=url, **SMALL)
    r = run_storm(config)
    assert r.ok, r.problems
    store = open_store(url)
    try:
        events, cursor = [], 0
        while rows := store.tail(cursor):
            events += [event for _, event in rows]
            cursor = rows[-1][0]
    finally:
        store.close()
    restarted = [e for e in events if isinstance(e, Fail) and e.reason == REASON_ENGINE_RESTARTED]
    assert restarted  # the producer's previous process held transfers when it died
    end_ts = config.start_ts + r.sim_seconds
    assert all(config.start_ts <= e.ts <= end_ts for e in restarted), (config.start_ts, restarted[0].ts)
    for source in {e.source for e in restarted}:
        stamps = [e.ts for e in sorted((e for e in events if e.source == source), key=lambda e: e.seq)]
        assert stamps == sorted(stamps), source  # its stamps never go back, the restart's included
