"""The soak in CI: 1.5 simulated hours per mode (about ten seconds each), every fault kind, restarts every
ten to twenty minutes. The benchmark (benchmarks/soak.py) runs six hours.

It still crosses what a long run must cross: the running ledgers forget sides `defer_timeout` after their
decision and the offline replay 60 s of log time after (about a hundred times each here), tombstone
generations rotate over a thousand times, engines come back from their store several times. Nothing
leaks, hangs, is released twice or early, or decodes wrong bytes; re-asks never load; reused ids are
refused by every engine that used them, restarts included; the replay reproduces the live decisions and
finds the same with and without compaction; memory stays within the bound derived from the config.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.connector.sim.report import soak_account, soak_figures
from kvledger.connector.sim.soak_config import STORM_KINDS_IN_SOAK, SoakConfig, SoakResult
from kvledger.connector.sim.storm import run_soak
from kvledger.ledger.limits import REPLAY_RETAIN_S

SEED = 20261201
CONFIG = SoakConfig(seed=SEED, sim_hours=1.5, restart_gap_min_s=600.0, restart_gap_max_s=1200.0)


@pytest.fixture(scope="module")
def soaks() -> list[SoakResult]:
    results = [run_soak(dataclasses.replace(CONFIG, mode=mode)) for mode in ("read", "write")]
    print()
    for result in results:
        print("\n".join(soak_account(result)))
    print(soak_figures(results))
    return results


def test_the_soak_passes_every_check(soaks: list[SoakResult]) -> None:
    for r in soaks:
        assert r.problems == [], f"seed {r.seed} {r.mode}: {r.problems}"
        assert (r.leaked_blocks, r.double_releases, r.premature_releases, r.hung_requests) == (0, 0, 0, 0)
        assert (r.integrity_failures, r.failed_reported_as_received, r.loaded_twice) == (0, 0, 0)
        assert r.replay_matches and r.compaction_invariant
        assert r.integrity_checked > 1000 and r.unexplained_findings == []


def test_it_crosses_every_retention_window_many_times(soaks: list[SoakResult]) -> None:
    for r in soaks:
        assert r.sim_hours >= 1.5
        assert r.sim_seconds > 100 * REPLAY_RETAIN_S  # the replay's retention, let alone defer_timeout's
        assert r.stepped_seconds < r.sim_seconds / 5  # the clock jumped over the idle time
        assert r.replay_compacted_sides > 1000  # the default offline replay compacted as it went
        assert r.tombstone_generations > 100  # tombstone generations rotated many times on every ledger
        assert all(n > CONFIG.tombstones_max for n in r.tombstones_evicted.values()), r.tombstones_evicted


def test_every_fault_kind_played_its_part(soaks: list[SoakResult]) -> None:
    for r in soaks:
        assert set(r.faults_injected) == set(STORM_KINDS_IN_SOAK), r.faults_injected
        assert r.reasks > 100 and r.recomputes > 10  # preempted after a load; failed loads asked again
        assert r.local_computes >= r.reasks + r.recomputes  # and each one computed locally
        assert r.restarts.get("producer", 0) >= 1 and r.restarts.get("consumer", 0) >= 1
        assert r.lost_requests > 0  # the engines died with requests in flight
        assert r.id_reuses > 100 and r.reuses_across_restart > 10
        assert r.reuses_wrongly_accepted == [] and r.unmapped_ids_refused == []
        # Reused ids were refused while the first owner's side was held whole, as a tombstone, and only
        # in the id memory past the tombstone bound.
        answered = {key.split(":")[1] for key in r.id_reuse_answers}
        assert {"whole", "tombstone", "id_memory"} <= answered, r.id_reuse_answers
    write = next(r for r in soaks if r.mode == "write")
    assert write.id_reuses_refused.get("consumer", 0) > 100  # WRITE consumers see reused ids first


def test_memory_stays_within_the_bound_derived_from_the_config(soaks: list[SoakResult]) -> None:
    for r in soaks:
        assert r.tracked_sides_bound == 4 * (4 * CONFIG.burst_requests_max + CONFIG.tombstones_max)
        assert 0 < r.peak_tracked_sides <= r.tracked_sides_bound
        assert max(r.peak_tracked_sides_per_ledger.values()) <= r.tracked_sides_bound_per_ledger
        assert 0 < r.refold_tracked_sides <= 2 * r.tracked_sides_bound_per_ledger  # a restart's two ledgers
        assert r.bookkeeping_left == []
