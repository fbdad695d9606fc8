"""The late_reader fault: consumers that start after their producer's deadline. With leases the KV is still
held and read right; with leases off the late reads are refused (load errors); with every protection off
(the negative control) the storm sees the corruption: received bytes that differ and premature releases."""

from __future__ import annotations

import pytest

from kvledger.connector.sim import StormConfig, run_storm
from kvledger.ledger.events import Mode

SMALL = dict(seed=3, requests=300, concurrency=64, faults=frozenset({"late_reader"}), fault_rate=0.1)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_leases_keep_late_readers_correct(mode: Mode) -> None:
    r = run_storm(StormConfig(mode=mode, **SMALL))  # type: ignore[arg-type]
    assert r.ok, r.problems
    assert r.late_reads > 0 and r.lease_renewals > 0
    assert r.corrupt_receives == 0 and r.premature_releases == 0
    assert r.failed_recving == 0  # held by the lease: every late read lands


def test_without_leases_late_reads_are_refused_never_corrupt() -> None:
    r = run_storm(StormConfig(mode="read", kv_lease_duration_s=0.0, **SMALL))  # type: ignore[arg-type]
    assert r.ok, r.problems
    assert r.late_reads > 0 and r.late_reads_refused == r.late_reads
    assert r.corrupt_receives == 0 and r.premature_releases == 0 and r.failed_recving == r.late_reads


def test_the_negative_control_shows_corrupt_receives_and_premature_releases() -> None:
    r = run_storm(StormConfig(mode="read", protections=False, **SMALL))  # type: ignore[arg-type]
    assert r.corrupt_receives > 0 and r.premature_releases > 0
    assert not r.ok
