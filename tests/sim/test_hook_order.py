"""The simulator calls the connector's hooks in vLLM's order in every step (connector/sim/hook_order.py):
above all, request_finished for a request that stopped in a step comes before that step's
update_connector_output, as in vLLM's `Scheduler.update_from_output`. A recorder watches the cores while a
storm and a soak run unchanged. tests/e2e/test_scheduler_hook_order.py records vLLM's own Scheduler."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvledger.connector.sim.check import evaluate
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.driver import Storm
from kvledger.connector.sim.hook_order import in_step_order, phases
from kvledger.connector.sim.soak import Soak
from kvledger.connector.sim.soak_check import evaluate_soak
from kvledger.connector.sim.soak_config import SoakConfig
from tests.sim.hook_recorder import Call, by_round, record_storm

CONFIG = StormConfig(seed=11, requests=300, concurrency=48, fault_rate=0.05)
SOAK = SoakConfig(
    seed=11, sim_hours=0.15, burst_requests_max=24, burst_gap_min_s=25.0, burst_gap_max_s=30.0,
    decode_min_s=0.05, decode_max_s=0.15, soak_faults=frozenset({"preempt_reask", "recompute", "id_reuse"}),
)  # fmt: skip
"""No restarts: an engine a restart builds is not watched."""

WORKER_PHASES = ["bind", "start_load", "wait_for_save", "get_finished", "take_load_errors"]
READ_PRODUCER_STEP = ["schedule", "build_meta", *WORKER_PHASES, "on_request_finished", "on_worker_output"]
"""A READ producer's step in which prefills finish and the output reports released transfers."""


def finishes_and_reports(step: list[Call], reported: str) -> bool:
    """A request stopped in this step, and the same step's update_connector_output reported a transfer done."""
    return any(c.name == "on_request_finished" for c in step) and any(
        c.name == "on_worker_output" and getattr(c.result, reported) for c in step
    )


def test_the_order_check_rejects_request_finished_after_update_connector_output() -> None:
    before = ["matched_tokens", "on_alloc", "matched_tokens", "build_meta", *WORKER_PHASES]
    assert in_step_order([*before, "on_request_finished", "on_request_finished", "on_worker_output", "stats"])
    assert not in_step_order([*before, "on_worker_output", "on_request_finished"])  # the simulator's old order
    assert not in_step_order(["build_meta", "matched_tokens"])
    assert not in_step_order(["get_finished", "wait_for_save"])
    assert in_step_order(["bind", "start_load", "save_layer", "wait_for_save"])  # synchronous loads
    assert in_step_order(["bind", "save_layer", "save_layer", "start_load", "wait_for_save"])  # asynchronous


@pytest.mark.parametrize("mode", ["read", "write"])
def test_every_storm_step_calls_the_hooks_in_vllms_order(mode: str) -> None:
    storm = Storm(dataclasses.replace(CONFIG, mode=mode))  # type: ignore[arg-type]
    calls = record_storm(storm)
    result = evaluate(storm, storm.run())
    assert result.ok, result.problems
    for engine, log in calls.items():
        for round_number, step in by_round(log).items():
            names = [c.name for c in step]
            assert in_step_order(names), (engine, round_number, phases(names))
    producer = by_round(calls["prefill-0"])
    cases = [step for step in producer.values() if finishes_and_reports(step, "finished_sending")]
    assert cases, "no step in which a prefill finished while another transfer's release was reported"
    if mode == "read":
        for step in cases:
            assert phases(c.name for c in step) == READ_PRODUCER_STEP
    # kv_load_failure_policy "fail": a load the workers report failed ends its request before the output.
    consumer = by_round(calls["decode-0"]).values()
    failing = [s for s in consumer if any(c.name == "get_finished" and c.result[2] for c in s)]
    assert any("on_request_finished" in phases(c.name for c in s) for s in failing)


def test_every_soak_step_calls_the_hooks_in_vllms_order(tmp_path: Path) -> None:
    """The soak's consumer ends decodes (request_finished) in steps whose output reports loads done."""
    soak = Soak(dataclasses.replace(SOAK, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}"))
    calls = record_storm(soak)
    soak.run()
    result = evaluate_soak(soak, soak.tally)
    assert result.ok, result.problems
    for engine, log in calls.items():
        for round_number, step in by_round(log).items():
            names = [c.name for c in step]
            assert in_step_order(names), (engine, round_number, phases(names))
    consumer = by_round(calls["decode-0"])
    assert any(finishes_and_reports(step, "finished_recving") for step in consumer.values())
