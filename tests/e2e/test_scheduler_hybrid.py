"""Hybrid models under vLLM's real Scheduler: LedgerConnector is `SupportsHMA`, so vLLM keeps its hybrid KV
cache manager on, and every KV cache group's blocks (full attention, a sliding window of another block size,
a Mamba state) are mapped, held, handed to the consumer and freed together, by the transfer's one release.

A model with a Mamba group is served as vLLM's NIXL connector serves it: the producer prefills the prompt one
token short (its Mamba state is h(N-1)), the consumer loads that much and computes the last token itself. WRITE
mode does the same: the producer's one prefill step writes every group's blocks, the Mamba state among them.

No engine, no weights: the workers' reports are written by hand, as in test_scheduler_contract.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from kvledger.connector.groups import NULL_BLOCK_ID
from kvledger.ledger.events import Map, block_groups_of
from tests.e2e.sched_harness import (
    NUM_BLOCKS,
    Clock,
    assert_empty,
    blocks_of,
    free_blocks,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
    step,
)
from tests.e2e.test_scheduler_contract import PRODUCER_PORTS

DEFER_TIMEOUT_S = 30.0
PROMPT_TOKENS = 100
FULL_BLOCK, WINDOW_BLOCK = 16, 32  # two attention block sizes; the scheduler's block is their multiple
GROUPS = ("full attention", "sliding window", "mamba")


def hybrid_groups(*, mamba: bool = True) -> list[KVCacheGroupSpec]:
    f32 = torch.float32
    groups = [
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size=FULL_BLOCK, num_kv_heads=1, head_size=1, dtype=f32)),
        KVCacheGroupSpec(
            ["swa.0"],
            SlidingWindowSpec(block_size=WINDOW_BLOCK, num_kv_heads=1, head_size=1, dtype=f32, sliding_window=32),
        ),
        KVCacheGroupSpec(["mamba.0"], MambaSpec(block_size=WINDOW_BLOCK, shapes=((2, 4), (4, 4)), dtypes=(f32, f32))),
    ]
    return groups if mamba else groups[:2]


CONSUMER_PORTS = {"handshake_port": 17400, "notify_port": 17500, "transport_port": 17600}
"""A WRITE producer's peer (it dials the consumer); the scheduler half opens no socket."""


def hybrid(model: str, role: str, policy: str = "fail", *, mode: str = "read", mamba: bool = True, **more: Any) -> Any:
    extra: dict[str, Any] = {"read_mode": mode == "read", "defer_timeout": DEFER_TIMEOUT_S, **more}
    if role == "kv_producer":
        extra.update(PRODUCER_PORTS)
        if mode == "write":
            extra["peers"] = [{"host": "127.0.0.1", **CONSUMER_PORTS}]
    else:
        extra["peers"] = [{"host": "127.0.0.1", **PRODUCER_PORTS}]
        if mode == "write":
            extra.update(CONSUMER_PORTS)
    config = make_vllm_config(model, role, extra, kv_load_failure_policy=policy)
    return make_scheduler(config, hybrid_groups(mamba=mamba), scheduler_block_size=WINDOW_BLOCK)


def live_blocks(scheduler: Any, request_id: str) -> list[list[int]]:
    """The request's blocks in every group, without vLLM's null placeholders."""
    return [[b for b in blocks_of(scheduler, request_id, g) if b != NULL_BLOCK_ID] for g in range(len(GROUPS))]


def the_map(scheduler: Any) -> Map:
    (mapped,) = [e for e in scheduler.connector.scheduler.ledger.log.since(0) if isinstance(e, Map)]
    return mapped


def prefill(scheduler: Any, tid: str) -> tuple[Any, dict[str, Any]]:
    request = make_request(PROMPT_TOKENS, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    scheduler.add_request(request)
    _, outputs = step(scheduler)
    (out,) = outputs[0].outputs
    assert out.finish_reason == FinishReason.LENGTH
    return request, out.kv_transfer_params


def test_vllm_runs_its_hybrid_kv_cache_manager_with_the_connector(model: str, clock: Clock) -> None:
    scheduler = hybrid(model, "kv_producer")
    assert isinstance(scheduler.connector, SupportsHMA)
    assert not scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [m.block_size for m in managers] == [FULL_BLOCK, WINDOW_BLOCK, WINDOW_BLOCK] and len(managers) == 3


def test_producer_holds_every_groups_blocks_until_the_release(model: str, clock: Clock) -> None:
    scheduler = hybrid(model, "kv_producer")
    request, handed = prefill(scheduler, "tx-h-hold")
    held = live_blocks(scheduler, request.request_id)
    # 100 tokens: 7 full-attention blocks of 16; the 32-token window keeps its last 2 blocks of 32; one Mamba state.
    assert [len(g) for g in held] == [7, 2, 1]
    assert NULL_BLOCK_ID in blocks_of(scheduler, request.request_id, 1)  # the window freed the blocks before it
    mapped = the_map(scheduler)
    assert block_groups_of(mapped.block_ids, mapped.block_groups) == tuple(tuple(g) for g in held)
    # The consumer is handed every group's blocks, group by group.
    assert handed["remote_block_groups"] == [7, 2, 1]
    assert handed["remote_block_ids"] == [b for g in held for b in g]
    for _ in range(3):
        clock.now += 1
        step(scheduler)
        assert live_blocks(scheduler, request.request_id) == held
    step(scheduler, finished_sending={request.request_id})
    assert_empty(scheduler)  # one release freed every group's blocks
    assert scheduler.connector.scheduler.stats()["released"] == {"completed": 1, "failed": 0, "expired": 0}


def test_producer_expire_frees_every_group(model: str, clock: Clock) -> None:
    # Leases off: the scheduler half's own deadline is defer_timeout (with leases on, its workers decide).
    scheduler = hybrid(model, "kv_producer", kv_lease_duration=0)
    prefill(scheduler, "tx-h-expire")
    before = free_blocks(scheduler)
    clock.now += DEFER_TIMEOUT_S + 1
    step(scheduler)
    assert_empty(scheduler)
    assert free_blocks(scheduler) - before == 7 + 2 + 1
    assert scheduler.connector.scheduler.stats()["released"]["expired"] == 1


def consumer_request(handed: dict[str, Any], max_tokens: int = 3) -> Any:
    return make_request(PROMPT_TOKENS, dict(handed), max_tokens=max_tokens)


def test_consumer_loads_into_every_group_then_recomputes_one_token(model: str, clock: Clock) -> None:
    _, handed = prefill(hybrid(model, "kv_producer"), "tx-h-load")
    scheduler = hybrid(model, "kv_consumer")
    request = consumer_request(handed)
    # The producer's Mamba state is h(N-1): the consumer loads one token short and computes the last one.
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (PROMPT_TOKENS - 1, True)
    scheduler.add_request(request)
    out, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    local = live_blocks(scheduler, request.request_id)
    mapped = the_map(scheduler)
    assert block_groups_of(mapped.block_ids, mapped.block_groups) == tuple(tuple(g) for g in local)
    assert mapped.remote_block_groups == (7, 2, 1)
    # Every group's blocks pair with the producer's, group by group (a load the fold would refuse has none).
    assert [len(g) for g in local] == [7, 2, 1]
    assert (scheduler.connector.scheduler.source, "tx-h-load") in scheduler.connector.scheduler.state.live
    # What the workers are told: the same blocks and counts, for the read of each layer's own group.
    (recv,) = out.kv_connector_metadata.step.recv
    assert recv.block_groups == (7, 2, 1) and recv.block_ids == mapped.block_ids
    assert recv.remote_block_groups == (7, 2, 1) and list(recv.remote_block_ids) == handed["remote_block_ids"]
    step(scheduler, finished_recving={request.request_id})
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {request.request_id: 1}  # the last prompt token only, from h(N-1)
    assert request.num_computed_tokens == PROMPT_TOKENS
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_hybrid_load_reports_every_groups_blocks(model: str, clock: Clock, policy: str) -> None:
    _, handed = prefill(hybrid(model, "kv_producer"), f"tx-h-fail-{policy}")
    scheduler = hybrid(model, "kv_consumer", policy)
    request = consumer_request(handed, max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)
    loaded_into = {b for g in live_blocks(scheduler, request.request_id) for b in g}
    core = scheduler.connector.scheduler
    # The workers' read failed. vLLM refuses block-level errors (invalid_block_ids) for a model with several
    # KV cache groups, so the workers report the request in failed_recving only, and so does the connector.
    _, outputs = step(scheduler, finished_recving={request.request_id}, failed_recving={request.request_id})
    (release,) = [t for t in core.state.transfers.values() if t.transfer_id == f"tx-h-fail-{policy}"]
    assert set(release.block_ids) == loaded_into and len(loaded_into) == 7 + 2 + 1 and not core.state.live
    if policy == "fail":
        finished = [o for o in outputs[0].outputs if o.request_id == request.request_id] if outputs else []
        assert finished and finished[0].finish_reason == FinishReason.ERROR
    else:
        out, _ = step(scheduler)
        assert out.num_scheduled_tokens == {request.request_id: PROMPT_TOKENS}  # recomputed, nothing trusted
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)
    assert core.stats()["released"]["failed"] == 1


@pytest.mark.parametrize("state", ["waiting", "waiting_for_remote_kvs"])
def test_an_aborted_hybrid_consumer_frees_every_group(model: str, clock: Clock, state: str) -> None:
    _, handed = prefill(hybrid(model, "kv_producer"), f"tx-h-abort-{state}")
    scheduler = hybrid(model, "kv_consumer")
    request = consumer_request(handed)
    scheduler.add_request(request)
    if state == "waiting_for_remote_kvs":
        step(scheduler)
        assert all(live_blocks(scheduler, request.request_id))
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    if state == "waiting_for_remote_kvs":
        step(scheduler)
        assert all(live_blocks(scheduler, request.request_id))  # the read may still land: vLLM keeps them
        step(scheduler, finished_recving={request.request_id})
    for _ in range(2):
        step(scheduler)
    assert_empty(scheduler)
    assert free_blocks(scheduler) == NUM_BLOCKS - 1
    assert not scheduler.connector.scheduler.state.live


def test_the_connector_names_a_failed_hybrid_load_by_request_never_by_block(model: str, clock: Clock) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    _, handed = prefill(hybrid(model, "kv_producer"), "tx-h-noblocks")
    scheduler = hybrid(model, "kv_consumer")
    request = consumer_request(handed)
    scheduler.add_request(request)
    step(scheduler)
    report = KVConnectorOutput(finished_recving={request.request_id}, failed_recving={request.request_id})
    scheduler.connector.update_connector_output(report)
    assert report.failed_recving == {request.request_id} and report.finished_recving == {request.request_id}
    assert not report.invalid_block_ids  # vLLM raises on any for a model with several KV cache groups


def write_params(tid: str, side: str) -> dict[str, Any]:
    """WRITE: what the proxy hands each side before either runs (the other side's address, no block ids)."""
    ports, flag = (CONSUMER_PORTS, "do_remote_decode") if side == "producer" else (PRODUCER_PORTS, "do_remote_prefill")
    return {
        flag: True,
        "transfer_id": tid,
        "remote_host": "127.0.0.1",
        "remote_handshake_port": ports["handshake_port"],
        "remote_notify_port": ports["notify_port"],
    }


def test_a_write_producer_writes_every_groups_blocks_from_its_one_prefill_step(model: str, clock: Clock) -> None:
    scheduler = hybrid(model, "kv_producer", mode="write")
    request = make_request(PROMPT_TOKENS, write_params("tx-hw-save", "producer"), max_tokens=5)
    scheduler.add_request(request)
    out = scheduler.schedule()
    # One token short, as in READ: the Mamba state written is h(N-1), and the consumer computes the last token.
    assert out.num_scheduled_tokens == {request.request_id: PROMPT_TOKENS - 1} and request.max_tokens == 1
    allocated = [blocks_of(scheduler, request.request_id, g) for g in range(len(GROUPS))]
    assert [len(g) for g in allocated] == [7, 4, 4]  # before the forward: every block of the 99 tokens
    (save,) = out.kv_connector_metadata.step.save
    scheduler.update_from_output(out, model_output([request]))
    held = live_blocks(scheduler, request.request_id)
    assert [len(g) for g in held] == [7, 2, 1]  # after it, the window's older blocks and the older states are gone
    # The workers write from, and their map holds, exactly what vLLM holds for the transfer after the step: the
    # window's blocks it keeps and the Mamba group's running state (the last of its list), each layer from its
    # own group. A block vLLM freed after the step is never written from, nor claimed by the workers' ledger.
    assert block_groups_of(save.block_ids, save.block_groups) == tuple(map(tuple, held))
    assert held[2] == [allocated[2][-1]] and held[1] == allocated[1][2:]
    mapped = the_map(scheduler)
    assert mapped.mode == "write" and (mapped.block_ids, mapped.block_groups) == (save.block_ids, save.block_groups)
    clock.now += 1
    step(scheduler)
    assert live_blocks(scheduler, request.request_id) == held
    step(scheduler, finished_sending={request.request_id})
    assert_empty(scheduler)  # one release freed every group's blocks
    assert scheduler.connector.scheduler.stats()["released"] == {"completed": 1, "failed": 0, "expired": 0}


def test_a_write_consumer_loads_every_group_one_token_short(model: str, clock: Clock) -> None:
    producer = hybrid(model, "kv_producer", mode="write")
    p_request = make_request(PROMPT_TOKENS, write_params("tx-hw-load", "producer"), max_tokens=1)
    scheduler = hybrid(model, "kv_consumer", mode="write")
    request = make_request(PROMPT_TOKENS, write_params("tx-hw-load", "consumer"), max_tokens=3)
    request.prompt_token_ids[:] = p_request.prompt_token_ids  # one prompt, handed to both sides by the proxy
    request._all_token_ids[:] = p_request.prompt_token_ids
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (PROMPT_TOKENS - 1, True)
    scheduler.add_request(request)
    out, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    local = live_blocks(scheduler, request.request_id)
    assert [len(g) for g in local] == [7, 2, 1]
    (recv,) = out.kv_connector_metadata.step.recv
    # remote_blocks carries every group's blocks and counts: the producer writes each layer into its own group.
    assert recv.mode == "write" and block_groups_of(recv.block_ids, recv.block_groups) == tuple(map(tuple, local))
    # Both sides bind the request by the digest of the N-1 tokens whose state moves (the producer's cut prompt).
    producer.add_request(p_request)
    (save,) = producer.schedule().kv_connector_metadata.step.save
    assert save.prompt_digest is not None and recv.prompt_digest == save.prompt_digest
    step(scheduler, finished_recving={request.request_id})
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {request.request_id: 1}  # the last prompt token only, from h(N-1)
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)
    assert scheduler.connector.scheduler.stats()["released"] == {"completed": 1, "failed": 0, "expired": 0}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_hybrid_write_fails_the_request_by_its_policy(model: str, clock: Clock, policy: str) -> None:
    scheduler = hybrid(model, "kv_consumer", policy, mode="write")
    request = make_request(PROMPT_TOKENS, write_params(f"tx-hw-fail-{policy}", "consumer"), max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)
    # The producer's Mamba write failed (write_failed): the workers report the request in failed_recving only.
    _, outputs = step(scheduler, finished_recving={request.request_id}, failed_recving={request.request_id})
    core = scheduler.connector.scheduler
    assert not core.state.live and core.stats()["released"]["failed"] == 1
    if policy == "fail":
        finished = [o for o in outputs[0].outputs if o.request_id == request.request_id] if outputs else []
        assert finished and finished[0].finish_reason == FinishReason.ERROR
    else:
        out, _ = step(scheduler)
        assert out.num_scheduled_tokens == {request.request_id: PROMPT_TOKENS}  # recomputed, nothing trusted
    while scheduler.requests:
        step(scheduler)
    assert_empty(scheduler)


def test_a_mamba_producer_prefills_one_token_short_once(model: str, clock: Clock) -> None:
    scheduler = hybrid(model, "kv_producer")
    request = make_request(PROMPT_TOKENS, {"do_remote_decode": True, "transfer_id": "tx-h-short"}, max_tokens=5)
    scheduler.add_request(request)
    out, _ = step(scheduler)
    # vLLM computes 99 tokens (state h(N-1)) and samples one, as under vLLM's NIXL connector.
    assert out.num_scheduled_tokens == {request.request_id: PROMPT_TOKENS - 1}
    assert request.num_prompt_tokens == PROMPT_TOKENS - 1 and request.max_tokens == 1
    # Asked again (a preemption re-adds nothing, but a second on_new_request must not cut again).
    scheduler.connector.on_new_request(request)
    assert request.num_prompt_tokens == PROMPT_TOKENS - 1 and len(request.prompt_token_ids) == PROMPT_TOKENS - 1


def test_an_attention_only_hybrid_loads_the_whole_prompt(model: str, clock: Clock) -> None:
    # Without Mamba state there is nothing one token short to derive: vLLM recomputes the last token itself.
    _, handed = prefill(hybrid(model, "kv_producer", mamba=False), "tx-h-attn")
    scheduler = hybrid(model, "kv_consumer", mamba=False)
    request = consumer_request(handed)
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (PROMPT_TOKENS, True)
    producer = hybrid(model, "kv_producer", mamba=False)
    local = make_request(PROMPT_TOKENS, {"do_remote_decode": True, "transfer_id": "tx-h-attn-2"}, max_tokens=1)
    producer.add_request(local)
    out, _ = step(producer)
    assert out.num_scheduled_tokens == {local.request_id: PROMPT_TOKENS}
