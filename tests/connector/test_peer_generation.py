"""A peer that restarts on the same ports, maybe with another KV layout (another num_blocks), is a new life of
that peer: what a handshake taught about the old one (geometry, region sizes, the transport session) must
never be used on the new one. Real cores, real ZMQ on loopback, the tcp transport moving CPU tensors.

Before generations the consumer kept the first handshake for its whole life: the restarted producer's blocks
were read with the old layout, and the wrong bytes were reported as a successful load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from kvledger.connector.assemble import build_scheduler, build_worker
from kvledger.connector.config import ConnectorConfig
from kvledger.connector.params import ParamsError, parse_params
from kvledger.connector.ports import free_loopback_ports, rank_port
from kvledger.connector.reasons import REASON_PEER_RESTARTED
from kvledger.connector.transports.tcp import TcpTransport
from kvledger.ledger.events import Fail, ReqId
from tests.connector.pd import BLOCK_SIZE, EnginePorts, Side, Ticks, block_bytes, make_config, run_until
from tests.connector.test_vllm_adapter import Engine, _request, patched_rank  # noqa: F401 (a fixture)

FIRST_BLOCKS = 32
RESTARTED_BLOCKS = 64
"""The restarted peer's num_blocks: layer 0 keeps K and V apart, `(2, num_blocks, ...)`, so every V run of a
block moves (the other layers, block-major, keep their offsets): a read with the old layout gets wrong bytes."""
PROMPT_TOKENS = 2 * BLOCK_SIZE


def _caches(num_blocks: int, fill: bool, seed: int) -> dict[str, torch.Tensor]:
    """tests/connector/pd.py's three layers, with `num_blocks` blocks."""
    g = torch.Generator().manual_seed(seed)

    def tensor(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype) if fill else torch.zeros(*shape, dtype=dtype)

    return {
        "layers.0.attn": tensor(2, num_blocks, BLOCK_SIZE, 2, 8),
        "layers.1.attn": tensor(num_blocks, 2, BLOCK_SIZE, 2, 8, dtype=torch.bfloat16),
        "layers.2.indexer": tensor(num_blocks, BLOCK_SIZE, 16, dtype=torch.float16),
    }


def _side(config: ConnectorConfig, num_blocks: int, *, fill: bool, seed: int, tell: bool = True) -> Side:
    """One engine (a new process's life). `tell`: its scheduler learns its worker's generation, as vLLM's
    EngineCore hands it over (False: params that name no generation, as from a proxy that drops the key)."""
    scheduler, worker = build_scheduler(config), build_worker(config)
    caches = _caches(num_blocks, fill, seed)
    worker.register_kv_caches(caches, num_blocks)
    if tell:
        scheduler.set_generations({config.tp_rank: worker.generation})
    return Side(scheduler, worker, caches)


class Pair:
    """A producer and a consumer; either can be restarted (closed, and a new life built on the same config)."""

    def __init__(self, mode: str, *, transfer_timeout_s: float = 30.0) -> None:
        p = free_loopback_ports(6)
        self.mode = mode
        prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
        timeouts = {"transfer_timeout_s": transfer_timeout_s, "defer_timeout_s": 2 * transfer_timeout_s}
        timeouts["recv_abort_timeout_s"] = 3 * transfer_timeout_s
        self.p_config = make_config("producer", mode, prod, cons, **timeouts)  # type: ignore[arg-type]
        self.c_config = make_config("consumer", mode, cons, prod, **timeouts)  # type: ignore[arg-type]
        self.producer = _side(self.p_config, FIRST_BLOCKS, fill=True, seed=1)
        self.consumer = _side(self.c_config, FIRST_BLOCKS, fill=False, seed=2)
        self.clock = Ticks()

    def restart_producer(self, num_blocks: int, *, tell: bool = True) -> None:
        self.producer.close()
        self.producer = _side(self.p_config, num_blocks, fill=True, seed=3, tell=tell)

    def restart_consumer(self, num_blocks: int) -> None:
        self.consumer.close()
        self.consumer = _side(self.c_config, num_blocks, fill=False, seed=4)

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()

    # -- READ --------------------------------------------------------------------------

    def produce(self, i: int, blocks: tuple[int, ...]) -> dict[str, Any]:
        """The prefill of request i finished: the producer holds `blocks` and answers the consumer's params."""
        params = parse_params({"transfer_id": f"tx-{i}", "do_remote_decode": True})
        keep, kv = self.producer.scheduler.on_request_finished(ReqId(f"p-{i}"), params, blocks, self.clock())
        assert keep and kv is not None
        self.producer.finished_pending.add(ReqId(f"p-{i}"))
        return kv

    def consume(self, i: int, kv: dict[str, Any], blocks: tuple[int, ...]) -> None:
        params = parse_params(kv)
        count, is_async = self.consumer.scheduler.matched_tokens(params, PROMPT_TOKENS, 0)
        assert is_async and count == PROMPT_TOKENS
        self.consumer.scheduler.on_alloc(ReqId(f"c-{i}"), params, blocks, count, self.clock())

    # -- WRITE -------------------------------------------------------------------------

    def write(self, i: int, p_blocks: tuple[int, ...], c_blocks: tuple[int, ...]) -> None:
        """The proxy sends both at once: the consumer allocates, the producer's prompt completes and finishes."""
        tid = f"tx-{i}"
        c_params = parse_params({"transfer_id": tid, "do_remote_prefill": True, **_address(self.p_config)})
        count, _ = self.consumer.scheduler.matched_tokens(c_params, PROMPT_TOKENS, 0)
        self.consumer.scheduler.on_alloc(ReqId(f"c-{i}"), c_params, c_blocks, count, self.clock())
        p_params = parse_params({"transfer_id": tid, "do_remote_decode": True, **_address(self.c_config)})
        self.producer.scheduler.on_save(ReqId(f"p-{i}"), p_params, p_blocks, self.clock())
        keep, _ = self.producer.scheduler.on_request_finished(ReqId(f"p-{i}"), p_params, p_blocks, self.clock())
        assert keep
        self.producer.finished_pending.add(ReqId(f"p-{i}"))

    # -- both ------------------------------------------------------------------------------

    def settle(self, i: int) -> None:
        """Step both until the consumer reported request i (received or failed) and the producer let it go."""
        c, p = ReqId(f"c-{i}"), ReqId(f"p-{i}")

        def done() -> bool:
            consumer_done = c in self.consumer.reported_recving or c in self.consumer.failed_recving
            return consumer_done and p in self.producer.reported_sending

        run_until([self.producer, self.consumer], done, clock=self.clock)

    def received(self, i: int) -> bool:
        c = ReqId(f"c-{i}")
        return c in self.consumer.reported_recving and c not in self.consumer.failed_recving

    def same_bytes(self, pairs: list[tuple[int, int]]) -> bool:
        """Whether each (producer block, consumer block) holds the same bytes in every layer."""
        p, c = self.producer.caches, self.consumer.caches
        return all(block_bytes(c, name, cb) == block_bytes(p, name, pb) for name in p for pb, cb in pairs)

    def untouched(self, blocks: tuple[int, ...]) -> bool:
        """Whether the consumer's `blocks` are still zero in every layer (no byte was moved into them)."""
        caches = self.consumer.caches
        return all(not block_bytes(caches, name, b).strip(b"\x00") for name in caches for b in blocks)

    def producer_link(self) -> Any:
        """The consumer's link state with producer rank 0."""
        port = rank_port(self.p_config.handshake_port, 0, 0, 1)
        return self.consumer.worker.linker.states[(self.p_config.host, port)]


def _address(config: ConnectorConfig) -> dict[str, Any]:
    return {
        "remote_host": config.host,
        "remote_handshake_port": config.handshake_port,
        "remote_notify_port": config.notify_port,
        "remote_engine_id": config.engine_id,
    }


@pytest.fixture
def read_pair() -> Iterator[Pair]:
    pair = Pair("read")
    yield pair
    pair.close()


def _linked_once(pair: Pair) -> int:
    """Transfer 0 before any restart: read right, with one handshake. Returns the producer's generation."""
    pair.consume(0, pair.produce(0, (3, 4)), (5, 6))
    pair.settle(0)
    assert pair.received(0) and pair.same_bytes([(3, 5), (4, 6)])
    first = pair.producer.worker.generation
    assert pair.producer_link().generation == first and pair.producer_link().attempts == 1
    return first


def test_a_producer_restarted_with_another_num_blocks_is_never_read_with_the_old_layout(read_pair: Pair) -> None:
    """Today: the second transfer is read with the first life's geometry, the V runs of layer 0 come from the
    wrong offsets, and vLLM hears a successful load. Now its params name the new life: the consumer forgets the
    link, handshakes again off the step, and reads with the new layout."""
    pair = read_pair
    first = _linked_once(pair)
    pair.restart_producer(RESTARTED_BLOCKS)
    second = pair.producer.worker.generation
    assert second != first
    kv = pair.produce(1, (7, 9))
    assert list(kv["remote_generations"]) == [second]
    pair.consume(1, kv, (10, 11))
    pair.settle(1)
    assert pair.received(1), pair.consumer.failed_recving
    assert pair.same_bytes([(7, 10), (9, 11)])
    link = pair.producer_link()
    assert link.attempts == 2 and link.generation == second and list(link.ended) == [first]
    assert pair.consumer.worker.counters["links_stale"] == 1
    assert not pair.consumer.invalid_blocks


def test_params_naming_no_generation_are_refused_by_the_restarted_peer_never_read_stale(read_pair: Pair) -> None:
    """Params that name no life (the restarted producer's scheduler was never told, or a proxy dropped the key):
    the stale session's read reaches the new process, whose transport refuses it (PEER_RESTARTED) before a byte
    moves. A load error, never a success; and the link is forgotten, so the next transfer handshakes again and
    reads right."""
    pair = read_pair
    _linked_once(pair)
    pair.restart_producer(RESTARTED_BLOCKS, tell=False)
    kv = pair.produce(1, (7, 9))
    assert "remote_generations" not in kv
    pair.consume(1, kv, (10, 11))
    pair.settle(1)
    assert not pair.received(1) and ReqId("c-1") in pair.consumer.failed_recving
    assert {10, 11} <= pair.consumer.invalid_blocks
    assert pair.untouched((10, 11))
    fails = [e for e in pair.consumer.worker.ledger.log.since(0) if isinstance(e, Fail) and e.transfer_id == "tx-1"]
    assert fails and fails[0].reason.startswith("PEER_RESTARTED")
    assert pair.consumer.worker.counters["links_forgotten_peer_gone"] == 1

    pair.consume(2, pair.produce(2, (12, 13)), (14, 15))
    pair.settle(2)
    assert pair.received(2) and pair.same_bytes([(12, 14), (13, 15)])
    assert pair.producer_link().attempts == 2


def test_a_transfer_naming_a_life_that_ended_fails_without_a_read(read_pair: Pair) -> None:
    """A transfer the first life handed out, taken by the consumer after it linked to the second life: its
    blocks died with the first process, so it fails at once (peer_restarted, a load error), no read issued and
    no handshake more."""
    pair = read_pair
    first = _linked_once(pair)
    old = pair.produce(1, (7, 8))  # handed out by the first life; the consumer has not taken it yet
    pair.restart_producer(RESTARTED_BLOCKS)
    pair.consume(2, pair.produce(2, (9, 10)), (11, 12))
    pair.settle(2)
    assert pair.received(2) and pair.same_bytes([(9, 11), (10, 12)])

    assert list(old["remote_generations"]) == [first]
    pair.consume(1, old, (13, 14))

    def failed() -> bool:
        return ReqId("c-1") in pair.consumer.failed_recving

    run_until([pair.producer, pair.consumer], failed, clock=pair.clock)
    assert {13, 14} <= pair.consumer.invalid_blocks and pair.untouched((13, 14))
    fails = [e for e in pair.consumer.worker.ledger.log.since(0) if isinstance(e, Fail) and e.transfer_id == "tx-1"]
    assert [f.reason.split(":")[0] for f in fails] == [REASON_PEER_RESTARTED]
    assert pair.consumer.worker.counters["transfers_peer_restarted"] == 1
    assert pair.producer_link().attempts == 2


def test_a_consumer_restarted_with_another_layout_is_never_written_with_the_old_one() -> None:
    """WRITE: the producer links to the consumer. The restarted consumer's remote_blocks carry its new life, so
    the producer handshakes again before it writes, and the bytes land where the new layout has them."""
    pair = Pair("write")
    try:
        pair.write(0, (3, 4), (5, 6))
        pair.settle(0)
        assert pair.received(0) and pair.same_bytes([(3, 5), (4, 6)])
        pair.restart_consumer(RESTARTED_BLOCKS)
        pair.write(1, (7, 9), (10, 11))
        pair.settle(1)
        assert pair.received(1), pair.consumer.failed_recving
        assert pair.same_bytes([(7, 10), (9, 11)])
        assert pair.producer.worker.counters["links_stale"] == 1
        port = rank_port(pair.c_config.handshake_port, 0, 0, 1)
        link = pair.producer.worker.linker.states[(pair.c_config.host, port)]
        assert link.attempts == 2 and link.generation == pair.consumer.worker.generation
    finally:
        pair.close()


class SilentTransport:
    """A real ROUTER on the producer's transport port that takes every request and answers none (a hung process
    whose control plane still answers)."""

    def __init__(self, port: int) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def test_a_peer_gone_transport_error_forgets_the_link(read_pair: Pair) -> None:
    """A read whose request gets no answer within its deadline (TIMEOUT: the peer is gone) fails, and the link
    it went over is forgotten: the next transfer handshakes again instead of trusting it."""
    pair = read_pair
    _linked_once(pair)
    transport = pair.consumer.worker.transport
    assert isinstance(transport, TcpTransport)
    transport.request_timeout_s = 0.2  # the transfer's own deadline stays 30 s: the request's passes first
    pair.producer.worker.transport.close()
    silent = SilentTransport(pair.p_config.my_port(pair.p_config.transport_port))
    try:
        pair.consume(1, pair.produce(1, (7, 8)), (9, 10))

        def failed() -> bool:
            return ReqId("c-1") in pair.consumer.failed_recving

        run_until([pair.producer, pair.consumer], failed, clock=pair.clock)
        fails = [e for e in pair.consumer.worker.ledger.log.since(0) if isinstance(e, Fail)]
        assert [f.reason.split(":")[0] for f in fails if f.transfer_id == "tx-1"] == ["TIMEOUT"]
        assert pair.consumer.worker.counters["links_forgotten_peer_gone"] == 1
        assert pair.producer_link().link is None

        pair.consume(2, pair.produce(2, (11, 12)), (13, 14))
        run_until([pair.producer, pair.consumer], lambda: pair.producer_link().attempts == 2, clock=pair.clock)
    finally:
        silent.close()


def test_remote_generations_name_one_life_per_rank() -> None:
    raw = {"transfer_id": "tx-1", "do_remote_prefill": True, "remote_tp_size": 2, "remote_generations": [7]}
    with pytest.raises(ParamsError, match="remote_generations"):
        parse_params(raw)
    params = parse_params({**raw, "remote_generations": [7, 8]})
    assert params is not None and params.remote_generations == (7, 8)


@pytest.mark.usefixtures("patched_rank")
def test_vllm_hands_the_workers_generations_to_the_scheduler_half() -> None:
    """vLLM's EngineCore gathers every worker's handshake metadata once their KV caches are registered and hands
    it to the scheduler half: from then on the params a producer hands out name its workers' generations."""
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    engine = Engine("kv_producer", "read", prod, cons, fill=True)
    try:
        params = {"transfer_id": "tx-1", "do_remote_decode": True}
        _, before = engine.scheduler.request_finished(_request("p-1", params), [1, 2, 3, 4])
        assert before is not None and "remote_generations" not in before
        handshake = engine.worker.get_handshake_metadata()
        assert handshake is not None
        engine.scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        _, after = engine.scheduler.request_finished(_request("p-2", {**params, "transfer_id": "tx-2"}), [5, 6])
        worker = engine.worker.worker  # type: ignore[attr-defined]  # the LedgerConnector's core
        assert after is not None and list(after["remote_generations"]) == [worker.generation] and worker.generation
    finally:
        engine.close()
