"""No hook waits on a peer, and every transport or peer fault becomes a `fail` event (issue 13, items 1 and 3).

Real ZMQ on loopback and the tcp transport. A dead peer is a port nothing listens on; a silent peer is a
ROUTER socket that takes the handshake request and never answers. No assertion is about time: "never
blocks" is shown by the hook having returned while the handshake is still in flight on the linker's thread
(a dead or silent peer keeps it there for the whole handshake timeout)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import zmq

from kvledger.connector.linker import Linker
from kvledger.connector.links import PeerLink
from kvledger.connector.messages import HandshakeMetadata
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.connector.reasons import REASON_LAYOUT, REASON_NOT_SENT, REASON_PEER_UNLINKED
from kvledger.connector.transports.base import Code, Op, TransferHandle, TransportEndpoint, failed
from kvledger.ledger.events import Event, Fail, ReqId, Schedule, TransferId
from tests.connector.pd import EnginePorts, Side, Ticks, make_config, run_until

TRANSFER_TIMEOUT_S = 5.0


def _fails(side: Side) -> list[Fail]:
    return [e for e in side.worker.ledger.log.since(0) if isinstance(e, Fail)]


def _events(side: Side, kind: type[Event]) -> list[Event]:
    return [e for e in side.worker.ledger.log.since(0) if isinstance(e, kind)]


def _ports() -> tuple[EnginePorts, EnginePorts]:
    p = free_loopback_ports(6)
    return EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])


def _read_params(prod: EnginePorts, tid: str = "tx-nb") -> Any:
    return parse_params(
        {
            "transfer_id": tid,
            "do_remote_prefill": True,
            "remote_block_ids": [0, 1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_handshake_port": prod.handshake,
            "remote_notify_port": prod.notify,
            "remote_engine_id": "prefill-0",
            "tp_size": 1,
        }
    )


@pytest.fixture
def silent_router() -> Iterator[tuple[EnginePorts, zmq.Socket[Any]]]:
    """A producer whose handshake port takes requests and never answers."""
    prod, _ = _ports()
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{prod.handshake}")
    try:
        yield prod, sock
    finally:
        sock.close(linger=0)
        context.term()


@pytest.mark.parametrize("peer", ["dead", "silent"])
def test_a_read_from_a_dead_or_silent_producer_never_blocks_and_fails_naming_the_peer(
    peer: str, request: pytest.FixtureRequest
) -> None:
    if peer == "silent":
        prod, router = request.getfixturevalue("silent_router")
        cons = _ports()[1]
    else:
        prod, cons = _ports()
        router = None
    consumer = Side.build(
        make_config("consumer", "read", cons, prod, transfer_timeout_s=TRANSFER_TIMEOUT_S), fill=False, seed=2
    )
    try:
        now = 1000.0
        consumer.scheduler.on_alloc(ReqId("c-nb"), _read_params(prod), (8, 9, 10, 11), 13, now)
        consumer.step(now)  # bind + start_load: the read waits for its link
        key = ("127.0.0.1", prod.handshake)
        assert consumer.worker.linker.in_flight() == [key]  # returned while the handshake is still out
        assert "tx-nb" in consumer.worker.waiting and not _fails(consumer)
        if router is not None:  # the silent peer really was asked
            assert router.poll(10_000) and router.recv_multipart()
        for _ in range(3):
            now += 1.0
            consumer.step(now)
            assert not consumer.failed_recving
        now += TRANSFER_TIMEOUT_S
        consumer.step(now)
        (fail,) = _fails(consumer)
        assert fail.reason == f"{REASON_PEER_UNLINKED}: 127.0.0.1:{prod.handshake}" and not fail.retryable
        assert consumer.failed_recving == {"c-nb"} and consumer.invalid_blocks == {8, 9, 10, 11}
        assert "tx-nb" not in consumer.worker.waiting
    finally:
        consumer.close()


def test_a_handshake_naming_a_transport_port_outside_the_allow_list_is_refused() -> None:
    prod, cons = _ports()
    producer = Side.build(make_config("producer", "read", prod, cons), fill=True, seed=1)
    # The consumer was told of another transport port than the one the producer's handshake will name.
    elsewhere = EnginePorts(prod.handshake, prod.notify, prod.transport + 1)
    consumer = Side.build(
        make_config("consumer", "read", cons, elsewhere, transfer_timeout_s=TRANSFER_TIMEOUT_S), fill=False, seed=2
    )
    try:
        clock = Ticks()
        params = parse_params({"transfer_id": "tx-redirect", "do_remote_decode": True})
        _, kv = producer.scheduler.on_request_finished(ReqId("p-r"), params, (0, 1, 2, 3), clock())
        consumer.scheduler.on_alloc(ReqId("c-r"), parse_params(kv), (8, 9, 10, 11), 13, clock())
        run_until([producer, consumer], lambda: consumer.worker.counters["handshake_redirect_refused"] > 0, clock=clock)
        assert not _events(consumer, Schedule)  # nothing read from the refused endpoint
        clock.now += TRANSFER_TIMEOUT_S
        run_until([producer, consumer], lambda: bool(consumer.failed_recving), clock=clock)
        (fail,) = _fails(consumer)
        assert fail.reason.startswith(REASON_PEER_UNLINKED)
        assert "not allow-listed" in consumer.worker.linker.describe(("127.0.0.1", prod.handshake))
    finally:
        producer.close()
        consumer.close()


# -- the linker: one attempt at a time per peer, success and failure cached ----------------------------


class FakePeer:
    """A handshake function whose answers the test releases one by one."""

    def __init__(self, answers: list[HandshakeMetadata | None]) -> None:
        self.answers = answers
        self.calls = 0
        self.go = threading.Semaphore(0)

    def __call__(self, host: str, port: int) -> HandshakeMetadata | None:
        self.calls += 1
        self.go.acquire()
        return self.answers.pop(0)


def _metadata() -> HandshakeMetadata:
    endpoint = TransportEndpoint(backend="tcp", host="127.0.0.1", port=1)
    return HandshakeMetadata(engine_id="p", dp_rank=0, tp_rank=0, tp_size=1, endpoint=endpoint, layers=())


def _settle(linker: Linker, now: float) -> None:
    assert linker.settle(time.monotonic() + 30.0, lambda peer: False)
    linker.admit(lambda peer: False)
    linker.adopt(now)


def test_the_linker_caches_a_failure_and_retries_only_after_the_backoff() -> None:
    peer = FakePeer([None, _metadata()])
    accepted: list[HandshakeMetadata] = []

    def accept(host: str, port: int, metadata: HandshakeMetadata) -> PeerLink:
        accepted.append(metadata)
        return PeerLink(metadata, session=object())

    linker = Linker(peer, accept, retry_cap_s=30.0, gated=True)
    key = ("127.0.0.1", 9)
    assert linker.link(key, 0.0) is None and linker.link(key, 0.0) is None
    peer.go.release()
    _settle(linker, 0.0)
    assert peer.calls == 1  # one attempt in flight at a time, however often it is asked
    for _ in range(5):
        assert linker.link(key, 0.01) is None  # inside the backoff: the failure is the answer
    assert peer.calls == 1 and linker.states[key].failures == 1
    peer.go.release()
    assert linker.link(key, 1.0) is None  # past the backoff: one more attempt
    _settle(linker, 1.0)
    link = linker.link(key, 1.0)
    assert link is not None and peer.calls == 2 and len(accepted) == 1
    assert all(linker.link(key, t) is link for t in (2.0, 100.0))  # success is cached too
    assert peer.calls == 2


def test_a_transport_connect_that_raises_is_a_failed_link_not_an_exception() -> None:
    peer = FakePeer([_metadata()])

    def accept(host: str, port: int, metadata: HandshakeMetadata) -> PeerLink:
        raise OSError("mori: cannot register the peer engine")

    linker = Linker(peer, accept, retry_cap_s=30.0, gated=True)
    key = ("127.0.0.1", 9)
    peer.go.release()
    assert linker.link(key, 0.0) is None
    _settle(linker, 0.0)
    assert linker.link(key, 0.0) is None
    assert linker.states[key].failures == 1 and "cannot register" in linker.states[key].reason


def test_the_backoff_never_exceeds_the_transfer_timeout() -> None:
    peer = FakePeer([None] * 8)
    linker = Linker(peer, lambda *a: PeerLink(_metadata(), object()), retry_cap_s=0.3, gated=True)
    key = ("127.0.0.1", 9)
    now = 0.0
    for _ in range(8):
        peer.go.release()
        assert linker.link(key, now) is None
        _settle(linker, now)
        assert linker.states[key].retry_at - now <= 0.3 + 1e-9
        now = linker.states[key].retry_at
    assert peer.calls == 8


class Writes:
    """Wraps a transport's writes and counts them; `instead(n)`, given the write's number, may raise or return
    a handle (a failed status) in place of the real write."""

    def __init__(self, inner: Any, instead: Callable[[int], TransferHandle | None] | None = None) -> None:
        self.inner, self.backend, self.instead, self.writes = inner, inner.backend, instead, 0

    def write(self, session: Any, local: str, remote: str, ops: Sequence[Op]) -> TransferHandle:
        self.writes += 1
        handle = self.instead(self.writes) if self.instead is not None else None
        return handle if handle is not None else self.inner.write(session, local, remote, ops)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _raise(n: int) -> TransferHandle | None:
    raise RuntimeError("QP in error state")


def _queue_full_once(n: int) -> TransferHandle | None:
    return TransferHandle(failed(Code.SEND_QUEUE_FULL, "SQ full", transient=True)) if n == 1 else None


# -- WRITE: faults are fails, at once -----------------------------------------------------------


def _write_pair(**consumer_overrides: Any) -> tuple[Side, Side, EnginePorts, EnginePorts]:
    prod, cons = _ports()
    producer = Side.build(make_config("producer", "write", prod, cons), fill=True, seed=1)
    consumer = Side.build(make_config("consumer", "write", cons, prod, **consumer_overrides), fill=False, seed=2)
    return producer, consumer, prod, cons


def _address(ports: EnginePorts, engine: str) -> dict[str, Any]:
    return {
        "remote_host": "127.0.0.1",
        "remote_handshake_port": ports.handshake,
        "remote_notify_port": ports.notify,
        "remote_engine_id": engine,
    }


def _write_both_sides(producer: Side, consumer: Side, tid: str, consumer_blocks: tuple[int, ...], clock: Ticks) -> None:
    """The proxy hands both sides the transfer: the consumer allocates; the producer prefills blocks (0, 1)
    and its request finishes (it holds them for the write)."""
    prod, cons = producer.scheduler.config, consumer.scheduler.config
    to_producer = _address(EnginePorts(prod.handshake_port, prod.notify_port, prod.transport_port), "prefill-0")
    to_consumer = _address(EnginePorts(cons.handshake_port, cons.notify_port, cons.transport_port), "decode-0")
    c_params = parse_params({"transfer_id": tid, "do_remote_prefill": True, **to_producer})
    consumer.scheduler.on_alloc(ReqId(f"c-{tid}"), c_params, consumer_blocks, 40, clock())
    p_params = parse_params({"transfer_id": tid, "do_remote_decode": True, **to_consumer})
    producer.scheduler.on_save(ReqId(f"p-{tid}"), p_params, (0, 1), clock())
    producer.scheduler.on_request_finished(ReqId(f"p-{tid}"), p_params, (0, 1), clock())
    producer.finished_pending.add(ReqId(f"p-{tid}"))


def test_a_write_consumer_with_more_blocks_than_the_producer_fails_at_once() -> None:
    producer, consumer, _prod, _cons = _write_pair()
    try:
        clock = Ticks()
        _write_both_sides(producer, consumer, "tx-big", (8, 9, 10), clock)
        run_until(
            [consumer, producer], lambda: bool(consumer.failed_recving and producer.reported_sending), clock=clock
        )
        (fail,) = _fails(producer)
        assert fail.reason.startswith(REASON_LAYOUT) and "consumer has 3 blocks, producer 2" in fail.reason
        assert not fail.retryable and fail.ts < 1000.0 + producer.scheduler.config.defer_timeout_s
        assert consumer.failed_recving == {"c-tx-big"} and consumer.invalid_blocks == {8, 9, 10}
    finally:
        producer.close()
        consumer.close()


def test_a_layer_saved_twice_is_written_once() -> None:
    producer, consumer, prod, cons = _write_pair()
    counting = Writes(producer.worker.transport)
    producer.worker.transport = counting  # type: ignore[assignment]
    try:
        clock = Ticks()
        c_params = parse_params({"transfer_id": "tx-twice", "do_remote_prefill": True, **_address(prod, "prefill-0")})
        consumer.scheduler.on_alloc(ReqId("c-2"), c_params, (8, 9), 40, clock())
        # The consumer's remote_blocks reach the producer, and its link completes, before the forward.
        run_until(
            [consumer, producer],
            lambda: bool(producer.worker.remote) and producer.worker.linker.link(("127.0.0.1", cons.handshake), 0.0),
            clock=clock,
        )
        p_params = parse_params({"transfer_id": "tx-twice", "do_remote_decode": True, **_address(cons, "decode-0")})
        producer.scheduler.on_save(ReqId("p-2"), p_params, (0, 1), clock())
        t = clock()
        producer.worker.bind(producer.scheduler.build_meta(), t)
        for name in producer.caches:
            producer.worker.save_layer(name)
            producer.worker.save_layer(name)  # vLLM saving a layer twice (e.g. a second attention call)
        producer.worker.wait_for_save(t)
        assert counting.writes == len(producer.caches)
    finally:
        producer.close()
        consumer.close()


def test_a_transport_write_that_raises_fails_the_transfer_and_the_hook_returns() -> None:
    producer, consumer, _prod, _cons = _write_pair()
    producer.worker.transport = Writes(producer.worker.transport, _raise)  # type: ignore[assignment]
    try:
        clock = Ticks()
        _write_both_sides(producer, consumer, "tx-raise", (8, 9), clock)
        run_until(
            [consumer, producer], lambda: bool(consumer.failed_recving and producer.reported_sending), clock=clock
        )
        (fail,) = _fails(producer)
        assert "QP in error state" in fail.reason and not fail.retryable
        assert consumer.failed_recving == {"c-tx-raise"}
    finally:
        producer.close()
        consumer.close()


def test_a_refused_remote_blocks_send_fails_the_write_consumer_at_once() -> None:
    producer, consumer, prod, _ = _write_pair()
    try:
        consumer.worker.channel.send = lambda *a: False  # type: ignore[method-assign]  # ZMQ's queue is full
        c_params = parse_params({"transfer_id": "tx-unsent", "do_remote_prefill": True, **_address(prod, "prefill-0")})
        consumer.scheduler.on_alloc(ReqId("c-4"), c_params, (8, 9), 40, 1000.0)
        consumer.step(1000.01)
        (fail,) = _fails(consumer)
        assert fail.reason == f"{REASON_NOT_SENT}: remote_blocks"
        assert consumer.failed_recving == {"c-4"} and consumer.invalid_blocks == {8, 9}
    finally:
        producer.close()
        consumer.close()


# -- retries: the window counts from the first transient failure ---------------------------------------


def test_a_write_deferred_past_the_transfer_timeout_is_still_retried_after_one_queue_full() -> None:
    producer, consumer, prod, cons = _write_pair()
    producer.worker.transport = Writes(producer.worker.transport, _queue_full_once)  # type: ignore[assignment]
    timeout = producer.scheduler.config.transfer_timeout_s
    try:
        clock = Ticks()
        p_params = parse_params({"transfer_id": "tx-slow", "do_remote_decode": True, **_address(cons, "decode-0")})
        producer.scheduler.on_save(ReqId("p-5"), p_params, (0, 1), clock())
        producer.scheduler.on_request_finished(ReqId("p-5"), p_params, (0, 1), clock())
        producer.finished_pending.add(ReqId("p-5"))
        producer.step(clock())  # mapped and sealed; the consumer has not said where to write yet
        clock.now += timeout + 10  # a slow consumer: its remote_blocks come after a transfer timeout
        c_params = parse_params({"transfer_id": "tx-slow", "do_remote_prefill": True, **_address(prod, "prefill-0")})
        consumer.scheduler.on_alloc(ReqId("c-5"), c_params, (8, 9), 40, clock())
        run_until(
            [consumer, producer], lambda: bool(consumer.reported_recving and producer.reported_sending), clock=clock
        )
        t = producer.worker.state.transfers[(producer.worker.source, TransferId("tx-slow"))]
        assert t.transient_failures == 1 and t.transient_since is not None and t.transient_since > 1000.0 + timeout
        assert t.decision is not None and t.decision.cause == "completed"
        assert not consumer.failed_recving
    finally:
        producer.close()
        consumer.close()


def test_finished_notices_of_consumer_requests_are_not_kept() -> None:
    producer, consumer, prod, _ = _write_pair()
    try:
        c_params = parse_params({"transfer_id": "tx-seen", "do_remote_prefill": True, **_address(prod, "prefill-0")})
        consumer.scheduler.on_alloc(ReqId("c-6"), c_params, (8, 9), 40, 1000.0)
        consumer.step(1000.01)
        consumer.finished_pending.add(ReqId("c-6"))  # vLLM finished (aborted) it while it waited
        consumer.step(1000.02)
        assert not consumer.worker._finished_seen
    finally:
        producer.close()
        consumer.close()
