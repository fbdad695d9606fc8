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

from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.events import Fail, block_groups_of
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
    def __init__(self, consumer_ssm: tuple[int, ...] = SSM, mode: str = "read") -> None:
        p = free_loopback_ports(6)
        prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
        p_view, self.p_raw = _mamba_cache(True, seed=3)
        c_view, self.c_raw = _mamba_cache(False, seed=4)
        self.producer = Engine(
            "kv_producer",
            mode,
            prod,
            cons,
            fill=True,
            kv_cache_config=_kv_cache_config(),
            more_caches={MAMBA_LAYER: p_view},
        )
        try:
            self.consumer = Engine(
                "kv_consumer",
                mode,
                cons,
                prod,
                fill=False,
                kv_cache_config=_kv_cache_config(consumer_ssm),
                more_caches={MAMBA_LAYER: c_view},
            )
        except BaseException:
            self.producer.close()
            raise
        for engine in (self.producer, self.consumer):
            engine.saved_layers.remove(MAMBA_LAYER)  # vLLM calls save_kv_layer for attention layers only

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

    def start_write(self, tid: str, p_groups: list[list[int]], c_groups: list[list[int]]) -> None:
        """WRITE: the consumer allocates first and says where to write; the producer's prompt runs in one step."""
        p_cfg, c_cfg = self.producer.scheduler.config, self.consumer.scheduler.config  # type: ignore[attr-defined]

        def params(flag: str, ports: Any) -> dict[str, Any]:
            return {
                "transfer_id": tid,
                flag: True,
                "remote_host": "127.0.0.1",
                "remote_handshake_port": ports.handshake_port,
                "remote_notify_port": ports.notify_port,
            }

        p_req, c_req = (
            _request("p-0", params("do_remote_decode", c_cfg)),
            _request("c-0", params("do_remote_prefill", p_cfg)),
        )
        count, is_async = self.consumer.scheduler.get_num_new_matched_tokens(c_req, 0)
        assert (count, is_async) == (len(PROMPT) - 1, True)  # h(N-1), as in READ
        self.consumer.scheduler.update_state_after_alloc(c_req, _blocks(c_groups), count)
        self.consumer.step()  # remote_blocks goes out before the producer's forward
        self.producer.scheduler.on_new_request(p_req)  # the prompt cut one token short: h(N-1) is what it leaves
        self.producer.scheduler.update_state_after_alloc(p_req, _blocks(p_groups), 0)
        self.producer.step()  # the forward: attention layers saved; the Mamba state pushed from wait_for_save
        keep, _ = self.producer.scheduler.request_finished_all_groups(p_req, tuple(p_groups))
        assert keep
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
    from kvledger.connector.transports.base import Code, TransferHandle, failed

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


@pytest.fixture
def write_pair(patched_rank: None) -> Iterator[Pair]:  # noqa: F811
    made = Pair(mode="write")
    try:
        yield made
    finally:
        made.close()


# WRITE: the producer is given its blocks at allocation, before the forward: the window group still lists every
# block of the prompt (the first one it leaves behind is cut), the Mamba group a block per 4 tokens, the last
# one the running state.
P_WRITE_GROUPS = [[1, 2, 3, 4], [20, 21, 5, 6], [22, 23, 24, 7]]


def test_write_moves_the_mamba_state_with_the_attention_blocks_as_one_transfer(write_pair: Pair) -> None:
    pair = write_pair
    pair.start_write("tx-mamba-w", P_WRITE_GROUPS, C_GROUPS)
    pair.run(3000)
    producer, consumer = pair.producer, pair.consumer
    assert producer.sent["p-0"] == 1 and consumer.received["c-0"] == 1 and not consumer.invalid
    for name in FULL_LAYERS:
        for pb, cb in zip(P_WRITE_GROUPS[0], C_GROUPS[0], strict=True):
            assert block_bytes(consumer.caches, name, cb) == block_bytes(producer.caches, name, pb)
    for pb, cb in ((5, 14), (6, 15)):  # the window's blocks, paired at the tail, from the window's own group
        assert block_bytes(consumer.caches, WINDOW_LAYERS[0], cb) == block_bytes(producer.caches, WINDOW_LAYERS[0], pb)
    # The running state's page landed byte for byte (pushed after the forward: vLLM never saves a Mamba layer),
    # its padding untouched; no other page was written.
    assert _page(pair.c_raw, 16)[:CONTENT_BYTES] == _page(pair.p_raw, 7)[:CONTENT_BYTES]
    assert not _page(pair.c_raw, 16)[CONTENT_BYTES:].strip(b"\x00")
    assert not pair.c_raw[: 16 * PAGE_BYTES].any() and not pair.c_raw[17 * PAGE_BYTES :].any()
    # One map per side names every group's blocks, the Mamba state among them; one release freed them all.
    p_worker = producer.worker.worker
    (p_side,) = p_worker.state.transfers.values()
    m = p_side.map_event
    assert m is not None and block_groups_of(m.block_ids, m.block_groups) == ((1, 2, 3, 4), (21, 5, 6), (7,))
    mamba_index = p_worker.layer_index[MAMBA_LAYER]
    assert p_side.expected == len(p_worker.layer_names) and p_side.acked_mask >> mamba_index & 1
    (c_side,) = consumer.worker.worker.state.transfers.values()
    assert c_side.map_event is not None and block_groups_of(c_side.block_ids, c_side.map_event.block_groups)[2] == (16,)
    for core in (producer.scheduler.scheduler, consumer.scheduler.scheduler):
        assert core.stats()["released"] == {"completed": 1, "failed": 0, "expired": 0}
    assert {d.cause for d in (p_side.decision, c_side.decision) if d is not None} == {"completed"}


def test_a_failed_mamba_write_fails_the_whole_transfer(write_pair: Pair) -> None:
    from kvledger.connector.transports.base import Code, TransferHandle, failed

    pair = write_pair
    transport = pair.producer.worker.worker.transport
    real_write = transport.write

    def write(session: Any, local: str, remote: str, ops: Any, **kw: Any) -> Any:
        if local == MAMBA_LAYER:
            return TransferHandle(failed(Code.REMOTE_ERROR, "mamba page lost"))
        return real_write(session, local, remote, ops, **kw)

    transport.write = write
    pair.start_write("tx-mamba-w-fail", P_WRITE_GROUPS, C_GROUPS)
    pair.run(3000)
    producer, consumer = pair.producer, pair.consumer
    p_worker = producer.worker.worker
    worker_fails = [e for e in p_worker.ledger.log.since(0) if isinstance(e, Fail)]
    assert worker_fails and "mamba page lost" in worker_fails[0].reason
    # The attention layers landed, yet the transfer failed on both sides: write_failed, never a partial success.
    (p_side,) = p_worker.state.transfers.values()
    (c_side,) = consumer.worker.worker.state.transfers.values()
    assert p_side.decision is not None and p_side.decision.cause == "failed"
    assert c_side.decision is not None and c_side.decision.cause == "failed"
    assert consumer.scheduler.scheduler.stats()["released"] == {"completed": 0, "failed": 1, "expired": 0}
    assert not pair.c_raw.any()  # the state never arrived
    # The producer frees every group's blocks at once.
    assert producer.sent["p-0"] == 1


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
