"""vLLM's own Scheduler driving LedgerConnector: blocks allocated, held, freed exactly when the connector
says; aborts in every state free blocks; load failures take vLLM's recompute or fail path.

No engine, no weights: the workers' reports are written by hand (as vLLM's unit tests do), so these
run in the default suite, not under the `vllm` marker.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvledger.connector.metadata import PeerRef
from kvledger.connector.params import consumer_params
from tests.e2e.sched_harness import (
    Clock,
    assert_empty,
    blocks_of,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
    step,
)

PRODUCER_PORTS = {"handshake_port": 17100, "notify_port": 17200, "transport_port": 17300}
DEFER_TIMEOUT_S = 30.0
PROMPT_TOKENS = 40  # three 16-token blocks


LEASE_MAX_S = 120.0


def producer(model: str, **more: Any) -> Any:
    extra = {"read_mode": True, "defer_timeout": DEFER_TIMEOUT_S, **PRODUCER_PORTS, **more}
    return make_scheduler(make_vllm_config(model, "kv_producer", extra))


def consumer(model: str, policy: str = "fail") -> Any:
    extra = {"read_mode": True, "peers": [{"host": "127.0.0.1", **PRODUCER_PORTS}]}
    return make_scheduler(make_vllm_config(model, "kv_consumer", extra, kv_load_failure_policy=policy))


def remote_decode_params(tid: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "transfer_id": tid}


def remote_prefill_params(tid: str) -> dict[str, Any]:
    return consumer_params(
        tid,  # type: ignore[arg-type]
        (5, 6, 7),
        PeerRef(
            engine_id="prefill-0",
            host="127.0.0.1",
            handshake_port=PRODUCER_PORTS["handshake_port"],
            notify_port=PRODUCER_PORTS["notify_port"],
        ),
    )


def finish_prefill(scheduler: Any, tid: str) -> Any:
    request = make_request(PROMPT_TOKENS, remote_decode_params(tid), max_tokens=1)
    scheduler.add_request(request)
    _, outputs = step(scheduler)
    (out,) = outputs[0].outputs
    assert out.finish_reason == FinishReason.LENGTH and out.kv_transfer_params["transfer_id"] == tid
    return request


# -- remote decode (the producer) -----------------------------------------------------


def test_producer_holds_blocks_until_the_connector_reports_the_release(model: str, clock: Clock) -> None:
    scheduler = producer(model)
    request = finish_prefill(scheduler, "tx-hold")
    held = blocks_of(scheduler, request.request_id)
    assert len(held) == 3
    for _ in range(3):  # steps without a release: the blocks stay
        clock.now += 1
        step(scheduler)
        assert blocks_of(scheduler, request.request_id) == held
    assert scheduler.connector.has_pending_block_frees()
    step(scheduler, finished_sending={request.request_id})  # the workers saw the consumer's release
    assert_empty(scheduler)
    step(scheduler, finished_sending={request.request_id})  # a duplicate report frees nothing twice
    assert_empty(scheduler)
    assert scheduler.connector.scheduler.stats()["released"] == {"completed": 1, "failed": 0, "expired": 0}


def test_producer_blocks_come_back_by_expire(model: str, clock: Clock) -> None:
    # Leases off: the scheduler half's own deadline is defer_timeout (with leases on its workers decide, and
    # report the release, as a lease expires; the test below).
    scheduler = producer(model, kv_lease_duration=0)
    request = finish_prefill(scheduler, "tx-expire")
    clock.now += DEFER_TIMEOUT_S - 1
    step(scheduler)
    assert blocks_of(scheduler, request.request_id)
    clock.now += 2
    step(scheduler)
    assert_empty(scheduler)
    assert scheduler.connector.scheduler.stats()["released"]["expired"] == 1


def test_with_leases_the_scheduler_half_holds_until_its_backstop_unless_its_workers_report(
    model: str, clock: Clock
) -> None:
    """With leases on, a renewal reaches the producer's workers, never its scheduler half: the workers decide
    (at defer_timeout, or one lease after the last renewal) and report it; the scheduler half's own deadline
    is kv_lease_max, the backstop should its workers die."""
    scheduler = producer(model, kv_lease_max=LEASE_MAX_S)
    reported = finish_prefill(scheduler, "tx-lease-report")
    backstop = finish_prefill(scheduler, "tx-lease-backstop")
    clock.now += DEFER_TIMEOUT_S + 1
    step(scheduler)
    assert blocks_of(scheduler, reported.request_id) and blocks_of(scheduler, backstop.request_id)
    step(scheduler, finished_sending={reported.request_id})  # its workers let it go (a lease expired)
    assert not blocks_of(scheduler, reported.request_id) and blocks_of(scheduler, backstop.request_id)
    clock.now += LEASE_MAX_S
    step(scheduler)
    assert_empty(scheduler)
    assert scheduler.connector.scheduler.stats()["released"] == {"completed": 1, "failed": 0, "expired": 1}


# -- remote prefill (the consumer) -------------------------------------------------------


def test_consumer_waits_for_the_load_then_decodes(model: str, clock: Clock) -> None:
    scheduler = consumer(model)
    request = make_request(PROMPT_TOKENS, remote_prefill_params("tx-load"), max_tokens=3)
    scheduler.add_request(request)
    out, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    held = blocks_of(scheduler, request.request_id)
    assert len(held) == 3
    step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and blocks_of(scheduler, request.request_id) == held
    step(scheduler, finished_recving={request.request_id})
    # Loaded: the last prompt token is recomputed locally, then the request decodes.
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {request.request_id: 1}
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)


@pytest.mark.parametrize("prompt_tokens", [33, 40, 48])  # one token into a block, mid-block, block-aligned
def test_a_whole_prompt_hit_loads_every_prompt_block_and_vllm_recomputes_only_the_last_token(
    model: str, clock: Clock, prompt_tokens: int
) -> None:
    """The consumer answers what the producer's KV covers (the whole prompt), as vLLM's own connectors do;
    vLLM's Scheduler then recomputes the last prompt token itself so that the next one can be sampled."""
    prefill = producer(model)
    request = make_request(prompt_tokens, remote_decode_params(f"tx-whole-{prompt_tokens}"), max_tokens=1)
    prefill.add_request(request)
    _, outputs = step(prefill)
    (finished,) = outputs[0].outputs
    handed = finished.kv_transfer_params
    remote_blocks = handed["remote_block_ids"]
    assert len(remote_blocks) == -(-prompt_tokens // 16)  # the producer filled one block per 16 prompt tokens

    scheduler = consumer(model)
    decode = make_request(prompt_tokens, dict(handed), max_tokens=3)
    decode.prompt_token_ids[:] = request.prompt_token_ids
    assert scheduler.connector.get_num_new_matched_tokens(decode, 0) == (prompt_tokens, True)
    scheduler.add_request(decode)
    out = scheduler.schedule()
    stats = scheduler.connector_prefix_cache_stats
    assert stats is not None and (stats.queries, stats.hits) == (prompt_tokens, prompt_tokens)
    assert not out.num_scheduled_tokens and decode.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(out, model_output([]))
    local = blocks_of(scheduler, decode.request_id)
    # One local block for every remote block: the worker pairs them one to one, none shifted.
    assert len(local) == len(remote_blocks)
    (recv,) = _maps(scheduler.connector.scheduler, f"tx-whole-{prompt_tokens}")
    assert recv.block_ids == tuple(local) and recv.remote_block_ids == tuple(remote_blocks)
    step(scheduler, finished_recving={decode.request_id})
    out, _ = step(scheduler)
    # vLLM recomputes the last prompt token of the whole-prompt hit: exactly one token, no new block.
    assert out.num_scheduled_tokens == {decode.request_id: 1}
    assert decode.num_computed_tokens == prompt_tokens and decode.num_output_tokens == 1
    assert blocks_of(scheduler, decode.request_id)[: len(local)] == local
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure_takes_the_policy_path(model: str, clock: Clock, policy: str) -> None:
    scheduler = consumer(model, policy)
    request = make_request(PROMPT_TOKENS, remote_prefill_params(f"tx-fail-{policy}"), max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)
    held = set(blocks_of(scheduler, request.request_id))
    _, outputs = step(scheduler, finished_recving={request.request_id}, failed_recving={request.request_id})
    if policy == "fail":
        finished = [o for o in outputs[0].outputs if o.request_id == request.request_id] if outputs else []
        assert finished and finished[0].finish_reason == FinishReason.ERROR
    else:
        out, _ = step(scheduler)
        # Recomputed from scratch: every prompt token scheduled locally, none trusted from the failed load.
        assert out.num_scheduled_tokens == {request.request_id: PROMPT_TOKENS}
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)
    assert held
    assert scheduler.connector.scheduler.stats()["released"]["failed"] == 1


# -- aborts in every state ------------------------------------------------------------------


def test_abort_producer_waiting_and_running(model: str, clock: Clock) -> None:
    scheduler = producer(model)
    waiting = make_request(PROMPT_TOKENS, remote_decode_params("tx-ab-w"), max_tokens=1)
    scheduler.add_request(waiting)
    scheduler.finish_requests(waiting.request_id, RequestStatus.FINISHED_ABORTED)
    assert_empty(scheduler)
    running = make_request(PROMPT_TOKENS, remote_decode_params("tx-ab-r"), max_tokens=4)
    scheduler.add_request(running)
    step(scheduler)
    assert running.status == RequestStatus.RUNNING
    scheduler.finish_requests(running.request_id, RequestStatus.FINISHED_ABORTED)
    step(scheduler)
    assert_empty(scheduler)  # READ: an aborted prefill hands no params out, so nothing is kept for a consumer


def test_abort_producer_after_it_finished_keeps_blocks_for_the_consumer(model: str, clock: Clock) -> None:
    scheduler = producer(model)
    request = finish_prefill(scheduler, "tx-ab-done")
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)  # too late: already finished
    step(scheduler)
    assert blocks_of(scheduler, request.request_id)
    step(scheduler, finished_sending={request.request_id})
    assert_empty(scheduler)


@pytest.mark.parametrize("state", ["waiting", "waiting_for_remote_kvs", "running"])
def test_abort_consumer(model: str, clock: Clock, state: str) -> None:
    scheduler = consumer(model)
    request = make_request(PROMPT_TOKENS, remote_prefill_params(f"tx-abc-{state}"), max_tokens=4)
    scheduler.add_request(request)
    if state != "waiting":
        step(scheduler)
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    if state == "running":
        step(scheduler, finished_recving={request.request_id})
        step(scheduler)
        assert request.status == RequestStatus.RUNNING
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    if state == "waiting_for_remote_kvs":
        # The worker may still be writing into these blocks: vLLM keeps them until the load is reported done.
        step(scheduler)
        step(scheduler, finished_recving={request.request_id})
    for _ in range(3):
        step(scheduler)
    assert_empty(scheduler)
    core = scheduler.connector.scheduler
    assert not core.state.live
    if state == "waiting":
        # Never allocated: the producer is told to release (an abort item for the workers).
        assert core.stats()["released"]["failed"] == 1


# -- re-asks and reused transfer ids (long runs) ------------------------------------------------


def _maps(core: Any, tid: str) -> list[Any]:
    from kvledger.ledger.events import Map

    return [e for e in core.ledger.log.since(0) if isinstance(e, Map) and e.transfer_id == tid]


def test_a_consumer_preempted_minutes_after_its_load_recomputes_locally(model: str, clock: Clock) -> None:
    scheduler = consumer(model)
    core = scheduler.connector.scheduler
    request = make_request(PROMPT_TOKENS, remote_prefill_params("tx-preempt"), max_tokens=50)
    scheduler.add_request(request)
    step(scheduler)
    step(scheduler, finished_recving={request.request_id})
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {request.request_id: 1}  # loaded: only the last prompt token is computed
    assert request.kv_transfer_params["do_remote_prefill"] is False  # the request's own params say so
    for _ in range(3):  # minutes of decoding: the connector compacts the long-decided side
        clock.now += 60
        step(scheduler)
    assert (core.source, "tx-preempt") not in core.state.transfers
    # What Scheduler.schedule() does when a running request cannot get a block: pop it, preempt it.
    scheduler.running.remove(request)
    scheduler._preempt_request(request, clock.now)
    assert request.num_computed_tokens == 0
    expected = request.num_tokens
    out, _ = step(scheduler)
    # Re-asked and answered "nothing to load": every token is computed here, nothing waits for a load.
    assert out.num_scheduled_tokens == {request.request_id: expected}
    assert request.status == RequestStatus.RUNNING
    assert len(_maps(core, "tx-preempt")) == 1 and not core.state.live
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    step(scheduler)
    assert_empty(scheduler)


def test_a_second_consumer_request_with_a_used_transfer_id_prefills_locally(model: str, clock: Clock) -> None:
    from kvledger.ledger.audit import audit

    scheduler = consumer(model)
    core = scheduler.connector.scheduler
    first = make_request(PROMPT_TOKENS, remote_prefill_params("tx-used"), max_tokens=2)
    scheduler.add_request(first)
    step(scheduler)
    step(scheduler, finished_recving={first.request_id})
    while scheduler.requests:
        step(scheduler)
    clock.now += 600
    second = make_request(PROMPT_TOKENS, remote_prefill_params("tx-used"), max_tokens=2)
    scheduler.add_request(second)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {second.request_id: PROMPT_TOKENS}  # no remote KV: a local prefill
    assert second.status == RequestStatus.RUNNING
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)
    (reuse,) = [f for f in audit(core.state, clock.now) if f.code == "id_reuse"]
    assert reuse.request_id == first.request_id and second.request_id in reuse.detail


def test_a_producer_request_with_a_used_transfer_id_is_freed_at_once(model: str, clock: Clock) -> None:
    scheduler = producer(model)
    first = finish_prefill(scheduler, "tx-twice")
    step(scheduler, finished_sending={first.request_id})
    assert_empty(scheduler)
    clock.now += 600
    second = make_request(PROMPT_TOKENS, remote_decode_params("tx-twice"), max_tokens=1)
    scheduler.add_request(second)
    _, outputs = step(scheduler)
    (out,) = outputs[0].outputs
    assert out.kv_transfer_params is None  # the consumer is handed nothing: it prefills locally
    assert_empty(scheduler)  # vLLM freed the blocks itself: nothing held for a side the fold refused
    assert not scheduler.connector.has_pending_block_frees()
