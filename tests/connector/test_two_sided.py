"""A real producer and consumer (scheduler + worker halves each), real ZMQ on loopback, the tcp
transport moving CPU tensors: bytes arrive, every transfer is released exactly once on each side,
and each side's log replays to the decisions it made live."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger import jsonl
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import ReqId, TransferId
from kvledger.ledger.fold import fold_all
from kvledger.ledger.ledger import Ledger
from tests.connector.pd import NUM_BLOCKS, EnginePorts, Side, block_bytes, make_config, run_until

TRANSFERS = 6
PROMPT_TOKENS = 14  # 4 blocks of 4 tokens


@pytest.fixture
def ports() -> tuple[EnginePorts, EnginePorts]:
    p = free_loopback_ports(6)
    return EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])


def _pair(mode: str, ports: tuple[EnginePorts, EnginePorts]) -> tuple[Side, Side]:
    prod_ports, cons_ports = ports
    producer = Side.build(make_config("producer", mode, prod_ports, cons_ports), fill=True, seed=1)  # type: ignore[arg-type]
    consumer = Side.build(make_config("consumer", mode, cons_ports, prod_ports), fill=False, seed=2)  # type: ignore[arg-type]
    return producer, consumer


@pytest.fixture(params=["read", "write"])
def pair(request: pytest.FixtureRequest, ports: tuple[EnginePorts, EnginePorts]) -> Iterator[tuple[Side, Side, str]]:
    producer, consumer = _pair(request.param, ports)
    try:
        yield producer, consumer, request.param
    finally:
        producer.close()
        consumer.close()


def _blocks(i: int, base: int) -> tuple[int, ...]:
    return tuple(range(base + 4 * i, base + 4 * i + 4))


def _log_releases(ledger: Ledger) -> list[Release]:
    return fold_all(ledger.log.since(0))[1]


def _jsonl_releases(ledger: Ledger, path: Path) -> list[Release]:
    jsonl.write_log(path, ledger.log.since(0), source=ledger.source)
    return fold_all(jsonl.read_events(path))[1]


def test_every_transfer_moves_bytes_and_releases_once(pair: tuple[Side, Side, str], tmp_path: Path) -> None:
    producer, consumer, mode = pair
    cons_peer = consumer.scheduler.config
    p_reqs = [ReqId(f"p-{i}") for i in range(TRANSFERS)]
    c_reqs = [ReqId(f"c-{i}") for i in range(TRANSFERS)]
    tids = [TransferId(f"tx-{mode}-{i}") for i in range(TRANSFERS)]
    now = 1000.0

    def tick() -> float:
        nonlocal now
        now += 0.001
        return now

    if mode == "read":
        # Producer: prefill done, request finished with its blocks; returns params for the consumer.
        consumer_params = []
        for i in range(TRANSFERS):
            params = parse_params({"transfer_id": tids[i], "do_remote_decode": True})
            keep, kv = producer.scheduler.on_request_finished(p_reqs[i], params, _blocks(i, 0), tick())
            assert keep and kv is not None and kv["remote_block_ids"] == list(_blocks(i, 0))
            producer.finished_pending.add(p_reqs[i])
            consumer_params.append(parse_params(kv))
        for i in range(TRANSFERS):
            count, is_async = consumer.scheduler.matched_tokens(consumer_params[i], PROMPT_TOKENS, 0)
            assert (count, is_async) == (PROMPT_TOKENS, True)
            consumer.scheduler.on_alloc(c_reqs[i], consumer_params[i], _blocks(i, 8), count, tick())
    else:
        cons_addr = {
            "remote_host": "127.0.0.1",
            "remote_handshake_port": cons_peer.handshake_port,
            "remote_notify_port": cons_peer.notify_port,
            "remote_engine_id": "decode-0",
        }
        prod_cfg = producer.scheduler.config
        prod_addr = {
            "remote_host": "127.0.0.1",
            "remote_handshake_port": prod_cfg.handshake_port,
            "remote_notify_port": prod_cfg.notify_port,
            "remote_engine_id": "prefill-0",
        }
        for i in range(TRANSFERS):
            # The proxy sends both at once; the consumer allocates and names its blocks.
            c_params = parse_params({"transfer_id": tids[i], "do_remote_prefill": True, **prod_addr})
            count, is_async = consumer.scheduler.matched_tokens(c_params, PROMPT_TOKENS, 0)
            assert is_async and count == PROMPT_TOKENS
            consumer.scheduler.on_alloc(c_reqs[i], c_params, _blocks(i, 8), count, tick())
            # Producer: the prompt completes in this step; it saves every layer during the forward.
            p_params = parse_params({"transfer_id": tids[i], "do_remote_decode": True, **cons_addr})
            producer.scheduler.on_save(p_reqs[i], p_params, _blocks(i, 0), tick())
        # Let the consumer's remote_blocks reach the producer for half of them before its forward.
        consumer.step(tick())
        producer.step(tick())
        for i in range(TRANSFERS):
            p_params = parse_params({"transfer_id": tids[i], "do_remote_decode": True, **cons_addr})
            keep, _ = producer.scheduler.on_request_finished(p_reqs[i], p_params, _blocks(i, 0), tick())
            assert keep
            producer.finished_pending.add(p_reqs[i])

    def done() -> bool:
        return set(producer.reported_sending) == set(p_reqs) and set(consumer.reported_recving) == set(c_reqs)

    run_until([producer, consumer], done, clock=tick)
    for _ in range(3):  # a few more rounds: nothing may be reported twice
        producer.step(tick())
        consumer.step(tick())

    assert all(n == 1 for n in producer.reported_sending.values()), producer.reported_sending
    assert all(n == 1 for n in consumer.reported_recving.values()), consumer.reported_recving
    assert not consumer.failed_recving and not consumer.invalid_blocks

    for i in range(TRANSFERS):
        for name in producer.caches:
            for p_block, c_block in zip(_blocks(i, 0), _blocks(i, 8), strict=True):
                assert block_bytes(consumer.caches, name, c_block) == block_bytes(producer.caches, name, p_block)
    untouched = [b for b in range(NUM_BLOCKS) if b not in {x for i in range(TRANSFERS) for x in _blocks(i, 8)}]
    for name in consumer.caches:
        for b in untouched:
            assert not block_bytes(consumer.caches, name, b).strip(b"\x00"), (name, b)

    for side in (producer, consumer):
        for ledger in (side.scheduler.ledger, side.worker.ledger):
            state = ledger.state
            decided = [t for t in state.transfers.values() if t.decision is not None]
            assert len(decided) == TRANSFERS and not state.live, ledger.source
            assert all(t.decision is not None and t.decision.cause == "completed" for t in decided)
            replayed = _log_releases(ledger)
            assert replayed == [t.decision for t in sorted(decided, key=lambda t: t.decision.seq)]  # type: ignore[union-attr]
            path = tmp_path / f"{ledger.source.replace('/', '_')}.jsonl"
            assert _jsonl_releases(ledger, path) == replayed
