"""A hybrid Mamba model's transfer through LedgerConnector's worker half: vLLM's own types, two engines' workers
over the tcp transport on loopback, the Mamba layer's state laid out as vLLM's hybrid allocator lays it out (one
page per block holding the conv state then the SSM state, padded), moved with the attention blocks as one
transfer. No engine starts. The scheduler half under vLLM's real Scheduler: tests/e2e/test_scheduler_hybrid.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from connector.ports import free_loopback_ports
from ledger.events import Fail, block_groups_of
from tests.connector.pd import BLOCK_SIZE, NUM_BLOCKS, EnginePorts, block_bytes
from tests.connector.test_vllm_adapter import PROMPT, Engine, _request, patched_rank  # noqa: F401 (fixture)

FULL_LAYERS, WINDOW_LAYERS, MAMBA_LAYER = ["layers.0.attn", "layers.2.indexer"], ["layers.1.attn"], "layers.3.mamba"
CONV, SSM = (3, 8), (2, 4, 4)  # float32: 96 B of conv state, then 128 B of SSM state
CONTENT_BYTES, PAGE_BYTES = 96 + 128, 256  # the allocator pads a Mamba page to the attention page
HANDSHAKE_WAIT_S = 30.0
"""A bound on waiting for the handshake thread on a loaded machine (not a timed assertion)."""


def _kv_cache_config(ssm: tuple[int, ...] = SSM) -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    f32 = torch.float32
    groups = [
        KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=f32)),
        KVCacheGroupSpec(
            WINDOW_LAYERS,
            SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=f32, sliding_window=8),
        ),
        KVCacheGroupSpec(
            [MAMBA_LAYER],
            MambaSpec(block_size=BLOCK_SIZE, shapes=(CONV, ssm), dtypes=(f32, f32), page_size_padded=PAGE_BYTES),
        ),
    ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _mamba_cache(fill: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the page view vLLM's runner gives the connector for a Mamba layer, the raw pages behind it): block b's
    states are bytes [b * PAGE_BYTES, b * PAGE_BYTES + CONTENT_BYTES) of the raw buffer; the rest is padding."""
    raw = torch.zeros(NUM_BLOCKS * PAGE_BYTES, dtype=torch.uint8)
    if fill:
        raw.copy_(torch.randint(1, 255, raw.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))
    view = torch.as_strided(raw, (NUM_BLOCKS, 1, 1, CONTENT_BYTES), (PAGE_BYTES, CONTENT_BYTES, CONTENT_BYTES, 1))
    return view, raw


def _page(raw: torch.Tensor, block: int) -> bytes:
    return raw[block * PAGE_BYTES : (block + 1) * PAGE_BYTES].numpy().tobytes()


def _blocks(per_group: list[list[int]]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    def block(i: int) -> KVCacheBlock:
        made = KVCacheBlock(i)
        made.is_null = i == 0
        return made

    return KVCacheBlocks(tuple([block(i) for i in group] for group in per_group))


class Pair:
    def __init__(self, consumer_ssm: tuple[int, ...] = SSM) -> None:
        p = free_loopback_ports(6)
        prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
        p_view, self.p_raw = _mamba_cache(True, seed=3)
        c_view, self.c_raw = _mamba_cache(False, seed=4)
        self.producer = Engine(
            "kv_producer",
            "read",
            prod,
            cons,
            fill=True,
            kv_cache_config=_kv_cache_config(),
            more_caches={MAMBA_LAYER: p_view},
        )
        try:
            self.consumer = Engine(
                "kv_consumer",
                "read",
                cons,
                prod,
                fill=False,
                kv_cache_config=_kv_cache_config(consumer_ssm),
                more_caches={MAMBA_LAYER: c_view},
            )
        except BaseException:
            self.producer.close()
            raise

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()

    def start(self, tid: str, p_groups: list[list[int]], c_groups: list[list[int]]) -> None:
        keep, params = self.producer.scheduler.request_finished_all_groups(
            _request("p-0", {"transfer_id": tid, "do_remote_decode": True}), tuple(p_groups)
        )
        assert keep and params is not None
        c_req = _request("c-0", params)
        count, is_async = self.consumer.scheduler.get_num_new_matched_tokens(c_req, 0)
        assert (count, is_async) == (len(PROMPT) - 1, True)  # h(N-1): the consumer computes the last token
        self.consumer.scheduler.update_state_after_alloc(c_req, _blocks(c_groups), count)
        self.producer.finished.add("p-0")

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if self.producer.sent and (self.consumer.received or self.consumer.invalid):
                break
            self.consumer.step()
            self.producer.step()


@pytest.fixture
def pair(patched_rank: None) -> Iterator[Pair]:  # noqa: F811
    made = Pair()
    try:
        yield made
    finally:
        made.close()


# The window keeps the last 2 of 4 blocks (vLLM's null block 0 stands for the others); the Mamba group lists a
# null placeholder before its running state, and the connector keeps the running state only.
P_GROUPS = [[1, 2, 3, 4], [0, 0, 5, 6], [0, 7]]
C_GROUPS = [[10, 11, 12, 13], [0, 0, 14, 15], [0, 16]]


def test_the_mamba_state_moves_with_the_attention_blocks_as_one_transfer(pair: Pair) -> None:
    pair.start("tx-mamba", P_GROUPS, C_GROUPS)
    pair.run(3000)
    producer, consumer = pair.producer, pair.consumer
    assert producer.sent["p-0"] == 1 and consumer.received["c-0"] == 1 and not consumer.invalid
    for name in FULL_LAYERS:
        for pb, cb in zip(P_GROUPS[0], C_GROUPS[0], strict=True):
            assert block_bytes(consumer.caches, name, cb) == block_bytes(producer.caches, name, pb)
    # The running state's page landed byte for byte, its padding untouched; no other page was written.
    assert _page(pair.c_raw, 16)[:CONTENT_BYTES] == _page(pair.p_raw, 7)[:CONTENT_BYTES]
    assert not _page(pair.c_raw, 16)[CONTENT_BYTES:].strip(b"\x00")
    assert not pair.c_raw[: 16 * PAGE_BYTES].any() and not pair.c_raw[17 * PAGE_BYTES :].any()
    # One map per side names every group's blocks, the Mamba state among them; one release freed them all.
    for side in (producer.scheduler.scheduler, consumer.scheduler.scheduler):
        (t,) = side.state.transfers.values()
        m = t.map_event
        assert m is not None and block_groups_of(m.block_ids, m.block_groups)[2] == (
            (7,) if side is producer.scheduler.scheduler else (16,)
        )
    assert producer.scheduler.scheduler.stats()["released"]["completed"] == 1


def test_a_failed_mamba_read_fails_the_whole_transfer(pair: Pair) -> None:
    from connector.transports.base import Code, TransferHandle, failed

    transport = pair.consumer.worker.worker.transport
    real_read = transport.read

    def read(session: Any, local: str, remote: str, ops: Any, **kw: Any) -> Any:
        if local == MAMBA_LAYER:
            return TransferHandle(failed(Code.REMOTE_ERROR, "mamba page lost"))
        return real_read(session, local, remote, ops, **kw)

    transport.read = read
    pair.start("tx-mamba-fail", P_GROUPS, C_GROUPS)
    pair.run(3000)
    consumer = pair.consumer
    # Reported as a failed receive (vLLM recomputes or fails the request), never as a received one.
    worker_fails = [e for e in consumer.worker.worker.ledger.log.since(0) if isinstance(e, Fail)]
    assert worker_fails and "mamba page lost" in worker_fails[0].reason
    assert consumer.scheduler.scheduler.stats()["released"] == {"completed": 0, "failed": 1, "expired": 0}
    # The producer is still told to let go, and frees every group's blocks at once.
    assert pair.producer.sent["p-0"] == 1


def test_a_peer_with_other_mamba_state_is_refused_at_handshake_naming_both(patched_rank: None) -> None:  # noqa: F811
    pair = Pair(consumer_ssm=(2, 4, 2))
    try:
        pair.start("tx-mamba-mismatch", P_GROUPS, C_GROUPS)
        worker = pair.consumer.worker.worker
        deadline = time.monotonic() + HANDSHAKE_WAIT_S  # the handshake runs on the linker's thread
        while not worker.counters["handshake_mamba_refused"] and time.monotonic() < deadline:
            pair.consumer.step()
            pair.producer.step()
            time.sleep(0.002)
        assert worker.counters["handshake_mamba_refused"] >= 1
        (peer,) = list(worker.waiting.peers())
        reason = worker.linker.describe(peer)
        assert "Mamba state differs" in reason and "decode-0" in reason and "prefill-0" in reason
        assert "float32[2, 4, 2]" in reason and "float32[2, 4, 4]" in reason
        assert not pair.c_raw.any() and not pair.consumer.received  # nothing moved into the consumer
    finally:
        pair.close()
