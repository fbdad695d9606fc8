"""Each fault of long runs on its own, at a high rate, in short soaks; and negative controls that show the
soak's checks catch the failures they are for."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvledger.connector.params import TransferParams
from kvledger.connector.sim.limits import REUSE_SOON_MAX_S, REUSE_SOON_MIN_S
from kvledger.connector.sim.soak import Soak, SoakRequest
from kvledger.connector.sim.soak_check import evaluate_soak
from kvledger.connector.sim.soak_config import SoakConfig, SoakResult
from kvledger.connector.sim.storm import run_soak
from kvledger.ledger.events import TransferId
from kvledger.ledger.ledger import Ledger

SEED = 31
QUIET = SoakConfig(seed=SEED, sim_hours=0.25, faults=frozenset(), soak_faults=frozenset())
"""No fault at all: each test turns on what it is about."""


@pytest.fixture
def store() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvledger-soak-test-") as folder:
        yield f"sqlite:///{Path(folder) / 'ledger.db'}"


def _run(soak: Soak) -> SoakResult:
    soak.run()
    return evaluate_soak(soak, soak.tally)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_request_asked_again_after_its_load_computes_locally(mode: str, store: str) -> None:
    config = dataclasses.replace(
        QUIET, mode=mode, soak_faults=frozenset({"preempt_reask"}), preempt_rate=0.8, ledger_url=store
    )
    soak = Soak(config)
    r = _run(soak)
    assert r.problems == [], r.problems
    assert r.reasks > 50 and r.loaded_twice == 0 and r.local_computes >= r.reasks
    preempted = [q for q in soak.requests if q.preemptions]
    assert preempted and all(q.loads == 1 and q.consumer.reported == 1 and q.state == "done" for q in preempted)
    # Re-asked minutes after the load too: long after the running ledger forgot the side.
    assert max(q.preemptions for q in preempted) == config.preemptions_max


def test_a_failed_load_is_asked_again_and_computed_locally(store: str) -> None:
    config = dataclasses.replace(
        QUIET,
        mode="write",
        faults=frozenset({"transfer_fail"}),
        fault_rate=0.3,
        soak_faults=frozenset({"recompute"}),
        ledger_url=store,
    )
    soak = Soak(config)
    r = _run(soak)
    assert r.problems == [], r.problems
    assert r.failed_recving > 10 and r.recomputes == r.failed_recving and r.loaded_twice == 0
    failed = [q for q in soak.requests if q.consumer.failed]
    assert all(q.loads == 1 and q.state == "done" and q.consumer.finished for q in failed)


def test_a_reused_id_is_refused_on_both_sides_with_nothing_held_and_nothing_waiting(store: str) -> None:
    config = dataclasses.replace(
        QUIET, mode="write", soak_faults=frozenset({"id_reuse"}), reuse_rate=0.5, ledger_url=store
    )
    soak = Soak(config)
    r = _run(soak)
    assert r.problems == [], r.problems
    assert r.id_reuses_refused.get("producer", 0) > 20 and r.id_reuses_refused.get("consumer", 0) > 20
    assert r.reuses_wrongly_accepted == [] and r.unmapped_ids_refused == []
    reused = [q for q in soak.requests if q.reuse_of is not None]
    assert reused
    for q in reused:
        # The prefill was freed by vLLM at once (no finished_sending), the decode computed locally.
        assert q.producer.finished and q.producer.reported == 0, q
        assert q.loads == 0 and q.consumer.reported == 0 and q.consumer.finished, q
    for engine in soak.engines:
        assert engine.scheduler.counters["transfer_id_reused"] > 0
        for ledger in engine.ledgers:
            assert not ledger.state.live and not ledger.state.unmapped and ledger.state.blocks_held == 0
        assert engine.pool.held == 0 and len(engine.scheduler.index) == 0
    assert r.findings.get("id_reuse", 0) > 0 and r.hung_requests == 0


def test_a_restarted_engine_refuses_the_ids_it_used_before_the_restart(store: str) -> None:
    config = dataclasses.replace(
        QUIET,
        mode="write",
        sim_hours=1.0,
        soak_faults=frozenset({"restart", "id_reuse"}),
        reuse_rate=0.3,
        restart_gap_min_s=300.0,
        restart_gap_max_s=600.0,
        ledger_url=store,
    )
    r = run_soak(config)
    assert r.problems == [], r.problems
    assert r.restarts.get("producer", 0) >= 1 and r.restarts.get("consumer", 0) >= 1
    assert r.reuses_across_restart > 10 and r.reuses_wrongly_accepted == []
    assert r.lost_requests > 0 and r.refold_tracked_sides <= 2 * r.tracked_sides_bound_per_ledger


def test_a_soak_with_restarts_is_reproducible() -> None:
    config = dataclasses.replace(
        QUIET,
        sim_hours=0.5,
        soak_faults=frozenset({"restart", "preempt_reask", "id_reuse"}),
        faults=frozenset({"drop", "late"}),
        fault_rate=0.05,
        restart_gap_min_s=200.0,
        restart_gap_max_s=400.0,
    )
    first, second = run_soak(config), run_soak(config)
    assert first.ok and sum(first.restarts.values()) >= 2
    assert (first.fingerprint, first.events, first.findings) == (second.fingerprint, second.events, second.findings)


# -- negative controls --------------------------------------------------------------


class ReasksLoseTheirParamsTestOnly(Soak):
    """Test-only: a harness whose requests forget that their remote KV was taken (vLLM's NIXL and MoRIIO
    connectors make the request say so), so a re-ask names the transfer again with do_remote_prefill."""

    def _schedule_consumer(self, request: SoakRequest, now: float) -> bool:  # type: ignore[override]
        before = request.consumer_params
        loads = super()._schedule_consumer(request, now)
        request.consumer_params = before
        return loads


class NothingGuardsReasksTestOnly(ReasksLoseTheirParamsTestOnly):
    """Test-only: and the consumer's scheduler no longer asks its ledger whether the id was used."""

    def _engine(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        engine = super()._engine(*args, **kwargs)
        if engine.config.role == "consumer":
            engine.scheduler._refused = lambda transfer_id: False  # type: ignore[method-assign]
        return engine


REASKS = dataclasses.replace(QUIET, soak_faults=frozenset({"preempt_reask"}), preempt_rate=0.8)


def test_the_ledger_alone_still_keeps_a_reask_from_loading_and_the_soak_flags_the_params(store: str) -> None:
    r = _run(ReasksLoseTheirParamsTestOnly(dataclasses.replace(REASKS, mode="read", ledger_url=store)))
    assert r.reasks > 50 and r.loaded_twice == 0 and r.hung_requests == 0  # the ledger remembered the id
    # Every later update_state_after_alloc claims the load again and maps the transfer again (a duplicate).
    assert r.second_alloc_claims > 0 and r.findings.get("duplicate", 0) > 0 and not r.ok


def test_without_either_guard_a_reask_loads_again_and_the_soak_says_so(store: str) -> None:
    r = _run(NothingGuardsReasksTestOnly(dataclasses.replace(REASKS, mode="read", ledger_url=store)))
    assert r.loaded_twice > 0 and not r.ok
    assert any("loaded twice" in p for p in r.problems)
    # The fold takes the second map for a duplicate and starts nothing, so the re-asked request waits in
    # WAITING_FOR_REMOTE_KVS for a load that never comes (the hang issue 12 describes).
    assert r.hung_requests > 0 and r.findings.get("duplicate", 0) > 0


def test_a_ledger_that_never_forgets_breaks_the_memory_bound(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Ledger, "maintain", lambda self, now, *, retain_s: 0)
    r = run_soak(dataclasses.replace(QUIET, sim_hours=0.5, ledger_url=store))
    assert r.peak_tracked_sides > r.tracked_sides_bound
    assert any("peak tracked sides" in p for p in r.problems)


class ReusesInFlightTestOnly(Soak):
    """Test-only: the proxy sends a transfer id again while its first transfer is still in flight."""

    def _arm_follow_ups(self, now: float) -> None:
        for number in self._follow_ups:
            self.timers.push("arrival", now + self.rng.uniform(REUSE_SOON_MIN_S, REUSE_SOON_MAX_S), number)
        self._follow_ups = []


def test_a_transfer_id_reused_while_its_first_write_is_in_flight_is_never_given_the_wrong_kv(store: str) -> None:
    config = dataclasses.replace(
        QUIET,
        mode="write",
        faults=frozenset({"never_ready"}),
        fault_rate=0.5,
        soak_faults=frozenset({"id_reuse"}),
        reuse_rate=1.0,
        ledger_url=store,
    )
    soak = ReusesInFlightTestOnly(config)
    r = _run(soak)
    collided = [q for q in soak.requests if q.reuse_of is not None and q.loads]
    assert collided, "no reuse met a first transfer in flight: the scenario did not happen"
    # Only the transfer id linked the two requests; the prompt digest in remote_blocks tells them apart:
    # the producer answers write_failed and the consumer's load fails (recomputed), never decoded.
    assert r.integrity_failures == 0, f"{r.integrity_failures} receives of another request's KV"
    assert r.problems == [], r.problems
    refused = soak.producer.worker.counters["remote_blocks_other_prompt"]
    assert refused > 0, "the producer never had to tell a consumer it holds the id for another prompt"


def test_the_harness_keeps_each_requests_params_as_vllm_does(store: str) -> None:
    """The harness keeps each request's params as vLLM keeps them: a taken load says so."""
    soak = Soak(dataclasses.replace(QUIET, sim_hours=0.05, ledger_url=store))
    r = _run(soak)
    assert r.ok
    loaded = [q for q in soak.requests if q.loads]
    assert loaded and all(isinstance(q.consumer_params, TransferParams) for q in loaded)
    assert all(not q.consumer_params.do_remote_prefill for q in loaded if q.consumer_params is not None)
    assert all(q.transfer_id == TransferId(f"tx-{SEED}-{q.number:06d}") for q in loaded)
