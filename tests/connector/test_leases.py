"""Leases and reads that cannot land on released blocks, over real ZMQ and the tcp transport on loopback:
a consumer that waits past the producer's deadline renews its hold and reads the right bytes; one that
stops renewing is expired one lease after its last renewal; without leases a late read is refused (a load
error), never served from released blocks."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kvledger.connector.limits import LEASE_RENEWALS_PER_LEASE
from kvledger.connector.messages import ReadConfirm
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.connector.transports.base import Code
from kvledger.connector.transports.tcp import TcpTransport
from kvledger.ledger.events import Ack, ReqId, Schedule, TransferId
from tests.connector.fake_mori import installed_as_mori
from tests.connector.pd import EnginePorts, Side, Ticks, block_bytes, make_config, run_until

TID = TransferId("tx-lease")
STEP_S = 0.25
DEFER_S = 2.0
LEASE_S = 3.0
PRODUCER_BLOCKS = (0, 1, 2, 3)
CONSUMER_BLOCKS = (8, 9, 10, 11)
WAIT_S = 10.0
DELIVERY_BOUND_S = 10.0
HANDSHAKE_CLOCK_S = 600.0
"""The hand-moved clock runs 0.25 s a step while handshakes take real time: a transfer timeout this long keeps
a slow handshake on a loaded machine from failing a transfer (nothing here is about handshakes)."""


def _pair(lease_s: float, **overrides: Any) -> tuple[Side, Side]:
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    common: dict[str, Any] = dict(
        defer_timeout_s=DEFER_S, transfer_timeout_s=HANDSHAKE_CLOCK_S, recv_abort_timeout_s=2 * HANDSHAKE_CLOCK_S,
        kv_lease_duration_s=lease_s, kv_lease_max_s=60.0,
    ) | overrides  # fmt: skip
    producer = Side.build(make_config("producer", "read", prod, cons, **common), fill=True, seed=1)
    consumer = Side.build(make_config("consumer", "read", cons, prod, **common), fill=False, seed=2)
    producer.tick_in_meta = consumer.tick_in_meta = True
    return producer, consumer


@pytest.fixture
def leased() -> Iterator[tuple[Side, Side]]:
    producer, consumer = _pair(LEASE_S)
    try:
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


@pytest.fixture
def unleased() -> Iterator[tuple[Side, Side]]:
    producer, consumer = _pair(0.0)
    try:
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


def _prefill_done(producer: Side, consumer: Side, now: float) -> dict[str, Any]:
    """The producer's request finishes; its params reach the consumer engine, where the request waits."""
    params = parse_params({"transfer_id": TID, "do_remote_decode": True})
    keep, kv = producer.scheduler.on_request_finished(ReqId("p-1"), params, PRODUCER_BLOCKS, now)
    assert keep and kv is not None
    producer.finished_pending.add(ReqId("p-1"))
    consumer.scheduler.on_new_request(ReqId("c-1"), parse_params(kv), now)
    return kv


def _side(side: Side) -> Any:
    return side.worker.state.side((side.worker.source, TID))


def _delivered(sender: Side, receiver: Side) -> None:
    """Wait (bounded) until every message `sender` queued has reached `receiver`'s listener, so that the
    hand-moved clock, not thread timing, decides when a renewal counts."""
    sent = sender.worker.channel.counters["sent"]
    limit = time.monotonic() + DELIVERY_BOUND_S
    while receiver.worker.channel.counters["received"] < sent and time.monotonic() < limit:
        time.sleep(0.001)


def _wait(producer: Side, consumer: Side, clock: Ticks, seconds: float) -> None:
    """Step both sides for `seconds` of the hand-moved clock (the consumer's request still waits)."""
    for _ in range(round(seconds / STEP_S)):
        now = clock()
        consumer.step(now)
        _delivered(consumer, producer)
        producer.step(now)


def test_a_consumer_waiting_past_the_deadline_keeps_the_kv_held_and_reads_it(leased: tuple[Side, Side]) -> None:
    producer, consumer = leased
    clock = Ticks(step_s=STEP_S)
    kv = _prefill_done(producer, consumer, clock.now)
    _wait(producer, consumer, clock, 4 * DEFER_S)  # a decode backlog four defer timeouts long
    held = _side(producer)
    assert held is not None and held.live, "the producer let go of a transfer whose consumer renewed"
    assert held.leases >= 2 and held.deadline > clock.now
    # The request is scheduled at last: it allocates and reads.
    consumer.scheduler.on_alloc(ReqId("c-1"), parse_params(kv), CONSUMER_BLOCKS, 13, clock.now)
    run_until([producer, consumer], lambda: bool(producer.reported_sending and consumer.reported_recving), clock=clock)
    assert not consumer.failed_recving
    p = _side(producer)
    assert p.decision.cause == "completed"  # released by the consumer's release, not by expiry
    for name in producer.caches:
        for theirs, mine in zip(PRODUCER_BLOCKS, CONSUMER_BLOCKS, strict=True):
            assert block_bytes(consumer.caches, name, mine) == block_bytes(producer.caches, name, theirs)
    renewals = [e for e in producer.worker.ledger.log.since() if isinstance(e, Ack) and e.what == "lease"]
    gaps = [b.ts - a.ts for a, b in itertools.pairwise(renewals)]
    assert gaps and min(gaps) >= LEASE_S / LEASE_RENEWALS_PER_LEASE - STEP_S  # a bounded rate


def test_a_consumer_that_stops_renewing_is_expired_one_lease_after_its_last_renewal(
    leased: tuple[Side, Side],
) -> None:
    producer, consumer = leased
    clock = Ticks(step_s=STEP_S)
    _prefill_done(producer, consumer, clock.now)
    _wait(producer, consumer, clock, 2 * DEFER_S)
    last = _side(producer).deadline
    assert last > clock.now + DEFER_S / 2  # renewed past the defer deadline
    # The decode engine crashes: no more renewals.
    run_until([producer], lambda: bool(producer.reported_sending), clock=clock)
    p = _side(producer)
    assert p.decision.cause == "expired" and p.decision.why == "lease_missed"
    assert last <= p.decision.ts < last + 2 * STEP_S
    assert producer.worker.state.lease_counts["expiries"] == 1


def test_without_leases_a_late_read_is_refused_and_reported_as_a_load_error(unleased: tuple[Side, Side]) -> None:
    producer, consumer = unleased
    clock = Ticks(step_s=STEP_S)
    kv = _prefill_done(producer, consumer, clock.now)
    run_until([producer, consumer], lambda: bool(producer.reported_sending), clock=clock)
    assert _side(producer).decision.cause == "expired"
    consumer.scheduler.on_alloc(ReqId("c-1"), parse_params(kv), CONSUMER_BLOCKS, 13, clock.now)
    run_until([producer, consumer], lambda: bool(consumer.reported_recving), clock=clock)
    assert consumer.failed_recving == {"c-1"}
    assert consumer.invalid_blocks >= set(CONSUMER_BLOCKS)
    c = _side(consumer)
    assert c.decision.cause == "failed" and c.decision.why == "read_refused"
    for name in consumer.caches:  # no byte of the released blocks arrived
        assert all(set(block_bytes(consumer.caches, name, b)) == {0} for b in CONSUMER_BLOCKS)


def test_the_negative_control_serves_released_blocks() -> None:
    """With the refusal off (and no leases) the same late read 'succeeds': what the refusal prevents."""
    producer, consumer = _pair(0.0, refuse_released_reads=False)
    try:
        clock = Ticks(step_s=STEP_S)
        kv = _prefill_done(producer, consumer, clock.now)
        run_until([producer, consumer], lambda: bool(producer.reported_sending), clock=clock)
        consumer.scheduler.on_alloc(ReqId("c-1"), parse_params(kv), CONSUMER_BLOCKS, 13, clock.now)
        run_until([producer, consumer], lambda: bool(consumer.reported_recving), clock=clock)
        assert not consumer.failed_recving  # reported as received, from blocks the producer had let go
    finally:
        producer.close()
        consumer.close()


@contextmanager
def _tcp_pair() -> Iterator[tuple[TcpTransport, TcpTransport, Any, torch.Tensor, torch.Tensor]]:
    """A producer's and a consumer's tcp transports on loopback, a 64-float region each, the consumer connected:
    (producer, consumer, session, producer's tensor, consumer's tensor)."""
    producer, consumer = TcpTransport("127.0.0.1", 0), TcpTransport("127.0.0.1", 0)
    try:
        src, dst = torch.arange(64, dtype=torch.float32), torch.zeros(64)
        remote = producer.register("kv", src)
        consumer.register("kv", dst)
        yield producer, consumer, consumer.connect(producer.endpoint(), [remote]), src, dst
    finally:
        producer.close()
        consumer.close()


def test_tcp_serves_a_read_only_while_its_transfer_is_held() -> None:
    with _tcp_pair() as (producer, consumer, session, src, dst):
        answers: dict[str, bool | None] = {"held": True, "gone": False, "unknown": None}
        producer.set_hold_check(answers.get)
        results = {}
        for tid in ("held", "gone", "unknown", ""):
            handle = consumer.read(session, "kv", "kv", [(0, 0, 64)], transfer_id=tid)
            assert consumer.wait_all([handle], WAIT_S)
            results[tid] = handle.status()
        assert results["held"].succeeded() and torch.equal(dst[:16], src[:16])
        assert results["gone"].code == Code.REFUSED and not results["gone"].transient
        assert results["unknown"].code == Code.NOT_HELD_YET and results["unknown"].transient
        assert results[""].code == Code.REFUSED  # a read that names no transfer is never served


def test_tcp_answers_a_request_whose_hold_check_raised_and_serves_on() -> None:
    with _tcp_pair() as (producer, consumer, session, src, dst):

        def held(tid: str) -> bool | None:
            if tid == "broken":
                raise KeyError(tid)
            return True

        producer.set_hold_check(held)
        broken = consumer.read(session, "kv", "kv", [(0, 0, 64)], transfer_id="broken")
        assert consumer.wait_all([broken], WAIT_S)
        assert broken.status().code == Code.REMOTE_ERROR and "broken" in broken.status().message
        served = consumer.read(session, "kv", "kv", [(0, 0, 64)], transfer_id="fine")
        assert consumer.wait_all([served], WAIT_S)
        assert served.status().succeeded() and torch.equal(dst[:16], src[:16])


# -- one-sided reads (mori, on the fake mori.io): confirmed with the producer before and after ------------------


def _mori_pair(lease_s: float, **overrides: Any) -> tuple[Side, Side]:
    with installed_as_mori():
        return _pair(lease_s, backend="mori", **overrides)


def test_a_one_sided_read_is_confirmed_before_and_after() -> None:
    # Held for as long as a slow handshake may take on a loaded machine (the clock moves a step per loop, the
    # handshake in real time): this is about the confirmations, not about a hold running out.
    producer, consumer = _mori_pair(0.0, defer_timeout_s=HANDSHAKE_CLOCK_S)
    try:
        assert consumer.worker.transport.one_sided
        clock = Ticks(step_s=STEP_S)
        kv = _prefill_done(producer, consumer, clock.now)
        consumer.scheduler.on_alloc(ReqId("c-1"), parse_params(kv), CONSUMER_BLOCKS, 13, clock.now)
        run_until(
            [producer, consumer], lambda: bool(producer.reported_sending and consumer.reported_recving), clock=clock
        )
        assert not consumer.failed_recving and consumer.worker.counters["reads_confirmed"] == 1
        assert producer.worker.counters["read_intents_held"] == 2  # before and after the read
        for name in producer.caches:
            for theirs, mine in zip(PRODUCER_BLOCKS, CONSUMER_BLOCKS, strict=True):
                assert block_bytes(consumer.caches, name, mine) == block_bytes(producer.caches, name, theirs)
    finally:
        producer.close()
        consumer.close()


def test_a_one_sided_read_of_a_released_transfer_is_never_issued() -> None:
    producer, consumer = _mori_pair(0.0)
    try:
        clock = Ticks(step_s=STEP_S)
        kv = _prefill_done(producer, consumer, clock.now)
        run_until([producer, consumer], lambda: bool(producer.reported_sending), clock=clock)  # expired
        consumer.scheduler.on_alloc(ReqId("c-1"), parse_params(kv), CONSUMER_BLOCKS, 13, clock.now)
        run_until([producer, consumer], lambda: bool(consumer.reported_recving), clock=clock)
        assert consumer.failed_recving == {"c-1"} and consumer.invalid_blocks >= set(CONSUMER_BLOCKS)
        assert _side(consumer).decision.why == "read_refused"
        assert not any(isinstance(e, Schedule) for e in consumer.worker.ledger.log.since())  # no read went
    finally:
        producer.close()
        consumer.close()


def test_a_one_sided_read_whose_hold_lapsed_meanwhile_is_a_load_error() -> None:
    producer, consumer = _mori_pair(0.0)
    try:
        clock = Ticks(step_s=STEP_S)
        kv = _prefill_done(producer, consumer, clock.now)
        consumer.scheduler.on_alloc(ReqId("c-1"), parse_params(kv), CONSUMER_BLOCKS, 13, clock.now)
        run_until([producer, consumer], lambda: consumer.worker._confirming.get(TID) == "after", clock=clock)
        # The producer's answer to "did you hold it throughout?" is no (its side lapsed while the NIC read).
        events: list[Any] = []
        consumer.worker._on_read_confirm(ReadConfirm(transfer_id=TID, rank=0, held=False, after=True), clock(), events)
        consumer.worker.ledger.extend(events)
        run_until([consumer], lambda: bool(consumer.reported_recving), clock=clock)
        assert consumer.failed_recving == {"c-1"}  # bytes landed, but are never decoded as this request's KV
        assert _side(consumer).decision.why == "read_refused"
    finally:
        producer.close()
        consumer.close()
