"""A hybrid model's transfer through LedgerConnector's worker half: vLLM's own types, two engines' workers over
the tcp transport, each layer moving the blocks of its own KV cache group. No engine starts.

Scheduler-side behaviour with several groups (vLLM's real Scheduler) is in tests/e2e/test_scheduler_hybrid.py;
a Mamba group's state in tests/connector/test_mamba_adapter.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvledger.connector.ports import free_loopback_ports
from tests.connector.pd import BLOCK_SIZE, NUM_BLOCKS, EnginePorts, block_bytes
from tests.connector.test_vllm_adapter import PROMPT, Engine, _request, patched_rank  # noqa: F401 (fixture)

# Full attention on layers 0 and 2, a sliding window on layer 1: two KV cache groups over one block pool.
FULL_LAYERS, WINDOW_LAYERS = ["layers.0.attn", "layers.2.indexer"], ["layers.1.attn"]


def _kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    f32 = torch.float32
    groups = [
        KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=f32)),
        KVCacheGroupSpec(
            WINDOW_LAYERS,
            SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=f32, sliding_window=8),
        ),
    ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _blocks(per_group: list[list[int]]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    def block(i: int) -> KVCacheBlock:
        made = KVCacheBlock(i)
        made.is_null = i == 0
        return made

    return KVCacheBlocks(tuple([block(i) for i in group] for group in per_group))


@pytest.fixture
def hybrid_engines(patched_rank: None) -> Iterator[tuple[Engine, Engine]]:  # noqa: F811
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = Engine("kv_producer", "read", prod, cons, fill=True, kv_cache_config=_kv_cache_config())
    try:
        consumer = Engine("kv_consumer", "read", cons, prod, fill=False, kv_cache_config=_kv_cache_config())
    except BaseException:
        producer.close()
        raise
    try:
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


def test_each_layer_reads_the_blocks_of_its_own_group(hybrid_engines: tuple[Engine, Engine]) -> None:
    producer, consumer = hybrid_engines
    # The window keeps the last 2 of 4 blocks: vLLM's null block (0) stands for the 2 it freed.
    p_groups, c_groups = [[1, 2, 3, 4], [0, 0, 5, 6]], [[10, 11, 12, 13], [0, 0, 14, 15]]
    p_req = _request("p-0", {"transfer_id": "tx-hma", "do_remote_decode": True})
    keep, kv_params = producer.scheduler.request_finished_all_groups(p_req, tuple(p_groups))
    assert keep and kv_params is not None
    assert kv_params["remote_block_ids"] == [1, 2, 3, 4, 5, 6] and kv_params["remote_block_groups"] == [4, 2]
    c_req = _request("c-0", kv_params)
    count, is_async = consumer.scheduler.get_num_new_matched_tokens(c_req, 0)
    assert (count, is_async) == (len(PROMPT), True)
    consumer.scheduler.update_state_after_alloc(c_req, _blocks(c_groups), count)
    producer.finished.add("p-0")
    for _ in range(3000):
        if producer.sent and consumer.received:
            break
        consumer.step()
        producer.step()
    for _ in range(3):
        consumer.step()
        producer.step()
    assert producer.sent["p-0"] == 1 and consumer.received["c-0"] == 1 and not consumer.invalid
    for name in FULL_LAYERS:
        for pb, cb in zip(p_groups[0], c_groups[0], strict=True):
            assert block_bytes(consumer.caches, name, cb) == block_bytes(producer.caches, name, pb)
    (window,) = WINDOW_LAYERS
    for pb, cb in ((5, 14), (6, 15)):
        assert block_bytes(consumer.caches, window, cb) == block_bytes(producer.caches, window, pb)
    # The window layer moved its own group's blocks only: the full-attention group's stayed untouched there.
    for cb in c_groups[0]:
        assert not block_bytes(consumer.caches, window, cb).strip(b"\x00")
