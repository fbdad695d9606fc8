"""vLLM's own Scheduler and the simulator call the connector's scheduler half in the same order, in the steps
that matter: a prefill stops while the workers report another transfer released, and (kv_load_failure_policy
"fail") a consumer's load is reported failed. Both are recorded at the same place, the scheduler core that
`LedgerConnector` calls one for one from vLLM's hooks.

No engine, no weights: the workers' reports are written by hand (as in test_scheduler_contract.py), so
this runs in the default suite; the simulator's step is recorded from a storm's producer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

pytest.importorskip("vllm")

from kvledger.connector.scheduler import SchedulerCore
from kvledger.connector.sim.driver import Storm
from kvledger.connector.sim.hook_order import HOOK_NAMES, in_step_order, phases
from tests.e2e.sched_harness import Clock, blocks_of, make_request, step
from tests.e2e.test_scheduler_contract import (
    PROMPT_TOKENS,
    consumer,
    finish_prefill,
    producer,
    remote_decode_params,
    remote_prefill_params,
)
from tests.sim.hook_recorder import Call, HookRecorder, by_round, record_storm
from tests.sim.test_hook_order import CONFIG, finishes_and_reports

WORKER_HOOKS = frozenset({"bind", "start_load", "save_layer", "wait_for_save", "get_finished", "take_load_errors"})
SCHEDULER_HOOKS = HOOK_NAMES - WORKER_HOOKS


def _recorded(scheduler: Any) -> list[Call]:
    """Put a recorder around the scheduler's connector core; returns its list of calls, filled from now on."""
    calls: list[Call] = []
    connector: Any = scheduler.connector
    connector.scheduler = cast(SchedulerCore, HookRecorder(connector.scheduler, calls.append, SCHEDULER_HOOKS))
    return calls


def _vllm_step(model: str, clock: Clock) -> list[Call]:
    """vLLM's Scheduler, READ producer: p-1 prefilled and held; then one step in which p-2 prefills and
    stops (max_tokens=1) while the workers report p-1's transfer released."""
    scheduler = producer(model)
    held = finish_prefill(scheduler, "tx-order-1")
    second = make_request(PROMPT_TOKENS, remote_decode_params("tx-order-2"), max_tokens=1)
    scheduler.add_request(second)  # add_request (on_new_request) comes before the step
    calls = _recorded(scheduler)
    clock.now += 1
    step(scheduler, finished_sending={held.request_id})
    assert second.is_finished() and blocks_of(scheduler, second.request_id)  # stopped, its blocks held
    assert not blocks_of(scheduler, held.request_id)  # p-1's freed in the same step
    return calls


def _vllm_failed_load_step(model: str, clock: Clock) -> list[Call]:
    """vLLM's Scheduler, READ consumer under kv_load_failure_policy "fail": the step whose workers report
    the request's load failed."""
    scheduler = consumer(model, "fail")
    request = make_request(PROMPT_TOKENS, remote_prefill_params("tx-order-fail"), max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)  # allocated; the load starts
    calls = _recorded(scheduler)
    clock.now += 1
    step(scheduler, finished_recving={request.request_id}, failed_recving={request.request_id})
    assert request.is_finished() and not scheduler.requests  # ended with an error, its blocks freed
    return calls


def _simulator_steps(engine: str, kind: Callable[[list[Call]], bool]) -> list[list[Call]]:
    """The storm engine's steps of one kind, its scheduler core's calls only."""
    storm = Storm(CONFIG)
    log = record_storm(storm)[engine]
    storm.run()
    steps = [s for s in by_round(log).values() if kind(s)]
    return [[c for c in s if c.name in SCHEDULER_HOOKS] for s in steps]


def _fails_a_load(step: list[Call]) -> bool:
    """The workers reported a load failed and the step ended a request for it."""
    failed = any(c.name == "get_finished" and c.result[2] for c in step)
    return failed and any(c.name == "on_request_finished" for c in step)


def test_the_simulator_calls_the_scheduler_half_in_the_order_vllms_scheduler_does(model: str, clock: Clock) -> None:
    real = _vllm_step(model, clock)
    names = [c.name for c in real]
    # vLLM's update_from_output: request_finished for p-2, then update_connector_output naming p-1.
    assert [c.name for c in real if c.name in ("on_request_finished", "on_worker_output")] == [
        "on_request_finished",
        "on_worker_output",
    ]
    assert in_step_order(names), names
    sim_steps = _simulator_steps("prefill-0", lambda s: finishes_and_reports(s, "finished_sending"))
    assert sim_steps
    # vLLM also asks the stats after update_connector_output (get_kv_connector_stats): not simulated.
    expected = [p for p in phases(names) if p != "stats"]
    for sim in sim_steps:
        assert phases(c.name for c in sim) == expected


def test_a_failed_load_ends_its_request_before_update_connector_output_in_both(model: str, clock: Clock) -> None:
    real = [c.name for c in _vllm_failed_load_step(model, clock)]
    assert in_step_order(real), real
    expected = [p for p in phases(real) if p != "stats"]
    assert expected == ["build_meta", "on_request_finished", "on_worker_output"]
    sim_steps = _simulator_steps("decode-0", _fails_a_load)
    assert sim_steps
    for sim in sim_steps:
        # The storm's consumer also admits other requests in the same step (the schedule phase).
        assert [p for p in phases(c.name for c in sim) if p != "schedule"] == expected
