"""The peer_restart_layout fault: the engine whose KV the other moves (READ: the producer; WRITE: the consumer)
dies mid-run and comes back on the same ports with twice the blocks, so every V run of its KV cache lies
elsewhere. With generations, the other engine handshakes again before it moves a byte of the new life and no
receive is wrong; the negative control (engines that name no generation, the connector as it was) moves the
new life's KV with the old layout and reports the wrong bytes as received."""

from __future__ import annotations

import pytest

from kvledger.connector.sim import StormConfig, run_storm
from kvledger.ledger.events import Mode

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
