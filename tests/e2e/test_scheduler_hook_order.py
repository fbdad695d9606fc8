"""vLLM's own Scheduler and the simulator call the connector's scheduler half in the same order, in the step
that matters: a prefill stops while the workers report another transfer released. Both are recorded at the
same place, the scheduler core that `LedgerConnector` calls one for one from vLLM's hooks.

No engine, no weights: the workers' reports are written by hand (as in test_scheduler_contract.py), so
this runs in the default suite; the simulator's step is recorded from a storm's producer.
"""

from __future__ import annotations

from typing import Any, cast

import pytest

pytest.importorskip("vllm")

from connector.scheduler import SchedulerCore
from connector.sim.driver import Storm
from connector.sim.hook_order import HOOK_NAMES, in_step_order, phases
from tests.e2e.sched_harness import Clock, blocks_of, make_request, step
from tests.e2e.test_scheduler_contract import PROMPT_TOKENS, finish_prefill, producer, remote_decode_params
from tests.sim.hook_recorder import Call, HookRecorder, by_round, record_storm
from tests.sim.test_hook_order import CONFIG, finishes_and_reports

WORKER_HOOKS = frozenset({"bind", "start_load", "save_layer", "wait_for_save", "get_finished", "take_load_errors"})
SCHEDULER_HOOKS = HOOK_NAMES - WORKER_HOOKS


def _vllm_step(model: str, clock: Clock) -> list[Call]:
    """vLLM's Scheduler, READ producer: p-1 prefilled and held; then one step in which p-2 prefills and
    stops (max_tokens=1) while the workers report p-1's transfer released."""
    scheduler = producer(model)
    held = finish_prefill(scheduler, "tx-order-1")
    second = make_request(PROMPT_TOKENS, remote_decode_params("tx-order-2"), max_tokens=1)
    scheduler.add_request(second)  # add_request (on_new_request) comes before the step
    calls: list[Call] = []
    connector: Any = scheduler.connector
    connector.scheduler = cast(SchedulerCore, HookRecorder(connector.scheduler, calls.append, SCHEDULER_HOOKS))
    clock.now += 1
    step(scheduler, finished_sending={held.request_id})
    assert second.is_finished() and blocks_of(scheduler, second.request_id)  # stopped, its blocks held
    assert not blocks_of(scheduler, held.request_id)  # p-1's freed in the same step
    return calls


def _simulator_steps() -> list[list[Call]]:
    """The storm producer's steps of the same kind, its scheduler core's calls only."""
    storm = Storm(CONFIG)
    log = record_storm(storm)["prefill-0"]
    storm.run()
    steps = [s for s in by_round(log).values() if finishes_and_reports(s, "finished_sending")]
    return [[c for c in s if c.name in SCHEDULER_HOOKS] for s in steps]


def test_the_simulator_calls_the_scheduler_half_in_the_order_vllms_scheduler_does(model: str, clock: Clock) -> None:
    real = _vllm_step(model, clock)
    names = [c.name for c in real]
    # vLLM's update_from_output: request_finished for p-2, then update_connector_output naming p-1.
    assert [c.name for c in real if c.name in ("on_request_finished", "on_worker_output")] == [
        "on_request_finished",
        "on_worker_output",
    ]
    assert in_step_order(names), names
    sim_steps = _simulator_steps()
    assert sim_steps
    # vLLM also asks the stats after update_connector_output (get_kv_connector_stats): not simulated.
    expected = [p for p in phases(names) if p != "stats"]
    for sim in sim_steps:
        assert phases(c.name for c in sim) == expected
