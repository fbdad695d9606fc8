"""vLLM's real `Scheduler` with LedgerConnector as its connector, on CPU with no weights: our own equivalents
of vLLM's unit-test helpers (a VllmConfig from the tiny model folder, a scheduler, requests, model outputs)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_BLOCKS = 64
EOS_TOKEN_ID = 2
_ids = itertools.count(1)


class Clock:
    """The connector's clock (`time.time` in the adapter), moved by hand: no test waits for time to pass.
    The `clock` fixture (conftest.py) installs one."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make_vllm_config(
    model: str, role: str, extra: dict[str, Any], *, kv_load_failure_policy: str = "fail"
) -> VllmConfig:
    model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=256)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=256,
            is_encoder_decoder=False,
            enable_chunked_prefill=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LedgerConnector",
            kv_connector_module_path="kvledger.connector",
            kv_role=role,  # type: ignore[arg-type]
            engine_id="prefill-0" if role == "kv_producer" else "decode-0",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
        ),
        device_config=DeviceConfig("cpu"),
    )


def make_scheduler(
    config: VllmConfig, groups: list[KVCacheGroupSpec] | None = None, scheduler_block_size: int = BLOCK_SIZE
) -> Scheduler:
    """vLLM's Scheduler over one full-attention KV cache group, or over `groups` (a hybrid model: vLLM's
    hybrid KV cache manager then runs, with one single-type manager per group, all from one block pool)."""
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=groups
        or [
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block_size,
        hash_block_size=min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups),
    )


def make_request(num_tokens: int, kv_transfer_params: dict[str, Any] | None, max_tokens: int = 4) -> Request:
    n = next(_ids)
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, EOS_TOKEN_ID)
    request = Request(
        request_id=f"req-{n}",
        prompt_token_ids=[3 + (i * n) % 900 for i in range(num_tokens)],
        sampling_params=sampling,
        pooling_params=None,
    )
    request.kv_transfer_params = kv_transfer_params
    return request


def model_output(
    requests: list[Request],
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    kv_connector_stats: Any = None,
    token: int = 7,
) -> ModelRunnerOutput:
    """What the workers would return for a step that ran `requests` (one sampled token each)."""
    ids = [r.request_id for r in requests]
    connector = KVConnectorOutput(
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        failed_recving=failed_recving or set(),
        invalid_block_ids=invalid_block_ids or set(),
        kv_connector_stats=kv_connector_stats,
    )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=connector,
    )


def step(scheduler: Scheduler, **connector_output: Any) -> tuple[Any, Any]:
    """schedule() then update_from_output() with one token for every request that ran."""
    out = scheduler.schedule()
    ran = [scheduler.requests[r] for r in out.num_scheduled_tokens if r in scheduler.requests]
    engine_outputs = scheduler.update_from_output(out, model_output(ran, **connector_output))
    return out, engine_outputs


def blocks_of(scheduler: Scheduler, request_id: str, group: int = 0) -> list[int]:
    """The request's block ids in one KV cache group, vLLM's null placeholders (block 0) included."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[group]
    return [b.block_id for b in manager.req_to_blocks.get(request_id, [])]


def free_blocks(scheduler: Scheduler) -> int:
    return int(scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks)


def assert_empty(scheduler: Scheduler) -> None:
    """Nothing left: no request, every block back in the pool (block 0 is vLLM's null block)."""
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:  # every KV cache group
        assert not manager.req_to_blocks
    assert free_blocks(scheduler) == NUM_BLOCKS - 1
