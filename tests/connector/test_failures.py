"""Seed behaviours on the failure paths, through the cores with real channels and the tcp transport."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.connector.transports.base import Code, Op, TransferHandle, failed
from kvledger.ledger.events import ReqId, TransferId
from tests.connector.pd import EnginePorts, Side, make_config, run_until


class Flaky:
    """Wraps a transport: the first `transient` reads fail with send-queue-full, or every read fails terminally."""

    def __init__(self, inner: Any, transient: int = 0, terminal: bool = False) -> None:
        self.inner, self.transient, self.terminal = inner, transient, terminal
        self.backend = inner.backend

    def read(
        self, session: Any, local: str, remote: str, ops: Sequence[Op], *, transfer_id: str = ""
    ) -> TransferHandle:
        if self.terminal:
            return TransferHandle(failed(Code.REMOTE_ERROR, "link down"))
        if self.transient > 0:
            self.transient -= 1
            return TransferHandle(failed(Code.SEND_QUEUE_FULL, "SQ full", transient=True))
        return self.inner.read(session, local, remote, ops, transfer_id=transfer_id)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def read_pair() -> Iterator[tuple[Side, Side]]:
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = Side.build(make_config("producer", "read", prod, cons), fill=True, seed=1)
    consumer = Side.build(make_config("consumer", "read", cons, prod, transfer_timeout_s=5.0), fill=False, seed=2)
    try:
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


def _start_read(producer: Side, consumer: Side, now: float) -> None:
    params = parse_params({"transfer_id": "tx-f", "do_remote_decode": True})
    _, kv = producer.scheduler.on_request_finished(ReqId("p-f"), params, (0, 1, 2, 3), now)
    producer.finished_pending.add(ReqId("p-f"))
    c_params = parse_params(kv)
    consumer.scheduler.on_alloc(ReqId("c-f"), c_params, (8, 9, 10, 11), 13, now)


def test_transient_read_failures_are_retried_then_succeed(read_pair: tuple[Side, Side]) -> None:
    producer, consumer = read_pair
    consumer.worker.transport = Flaky(consumer.worker.transport, transient=4)  # type: ignore[assignment]
    clock = iter(1000.0 + 0.01 * i for i in range(100000))
    _start_read(producer, consumer, next(clock))
    run_until(
        [producer, consumer],
        lambda: bool(producer.reported_sending and consumer.reported_recving),
        clock=lambda: next(clock),
    )
    t = consumer.worker.state.transfers[(consumer.worker.source, TransferId("tx-f"))]
    assert t.decision is not None and t.decision.cause == "completed"
    assert t.transient_failures >= 1 and t.retries >= 1
    assert not consumer.failed_recving


def test_terminal_read_failure_reports_load_errors_and_releases_the_producer(read_pair: tuple[Side, Side]) -> None:
    producer, consumer = read_pair
    consumer.worker.transport = Flaky(consumer.worker.transport, terminal=True)  # type: ignore[assignment]
    clock = iter(1000.0 + 0.01 * i for i in range(100000))
    _start_read(producer, consumer, next(clock))
    run_until(
        [producer, consumer],
        lambda: bool(producer.reported_sending and consumer.reported_recving),
        clock=lambda: next(clock),
    )
    assert consumer.failed_recving == {"c-f"}
    assert consumer.invalid_blocks == {8, 9, 10, 11}
    p = producer.worker.state.transfers[(producer.worker.source, TransferId("tx-f"))]
    assert p.decision is not None and p.decision.cause == "completed"  # released by the consumer, not by expiry


def test_transient_failures_past_transfer_timeout_become_terminal(read_pair: tuple[Side, Side]) -> None:
    producer, consumer = read_pair
    consumer.worker.transport = Flaky(consumer.worker.transport, transient=10**9)  # type: ignore[assignment]
    clock = iter(1000.0 + 0.5 * i for i in range(100000))  # half a second a round: 5 s pass quickly
    _start_read(producer, consumer, next(clock))
    run_until([producer, consumer], lambda: bool(consumer.reported_recving), clock=lambda: next(clock))
    t = consumer.worker.state.transfers[(consumer.worker.source, TransferId("tx-f"))]
    assert t.decision is not None and t.decision.cause == "failed" and "transfer_timeout" in t.decision.reason
    assert consumer.failed_recving == {"c-f"}


def test_write_whose_remote_never_became_ready_expires_and_releases() -> None:
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = Side.build(make_config("producer", "write", prod, cons, defer_timeout_s=2.0), fill=True, seed=1)
    try:
        cons_addr = {
            "remote_host": "127.0.0.1",
            "remote_handshake_port": cons.handshake,
            "remote_notify_port": cons.notify,
        }
        params = parse_params({"transfer_id": "tx-w", "do_remote_decode": True, **cons_addr})
        clock = iter(1000.0 + 0.5 * i for i in range(100000))
        producer.scheduler.on_save(ReqId("p-w"), params, (0, 1), next(clock))
        producer.step(next(clock))
        assert producer.scheduler.on_request_finished(ReqId("p-w"), params, (0, 1), next(clock))[0]
        producer.finished_pending.add(ReqId("p-w"))
        assert producer.scheduler.has_pending_push_work()
        run_until([producer], lambda: bool(producer.reported_sending), clock=lambda: next(clock))
        worker = producer.worker.ledger
        t = worker.state.transfers[(worker.source, TransferId("tx-w"))]
        assert t.decision is not None and t.decision.cause == "expired"
        # The scheduler frees when its workers report the send finished (whatever their cause), once.
        assert producer.reported_sending == {"p-w": 1}
        assert not producer.scheduler.has_pending_push_work()
    finally:
        producer.close()


def test_release_before_the_producer_maps_is_kept_and_applied() -> None:
    from kvledger.ledger.events import Ack, Map

    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = Side.build(make_config("producer", "read", prod, cons), fill=True, seed=1)
    try:
        ledger = producer.worker.ledger
        ledger.append(Ack(ts=1.0, source=ledger.source, transfer_id=TransferId("tx-e"), what="release"))
        release = ledger.append(
            Map(
                ts=2.0,
                source=ledger.source,
                transfer_id=TransferId("tx-e"),
                request_id=ReqId("p-e"),
                role="producer",
                mode="read",
                block_ids=(1,),
                deadline=60.0,
            )
        )
        assert release is not None and release.cause == "completed"
    finally:
        producer.close()
