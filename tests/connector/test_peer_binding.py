"""What a signed control message is bound to (issue 36, item 4), over real ZMQ on loopback: the MAC covers
the rank it was sent to, so a message recorded on its way to one rank and replayed to another is refused;
and a lease renewal holds a producer's blocks only when it comes from the consumer the transfer is bound to,
not from any other peer that holds the key."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from kvledger.connector.channel import Channel
from kvledger.connector.messages import LeaseRenew, RankAddress, ReleaseBlocks
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.events import Ack, ReqId, TransferId
from tests.connector.pd import EnginePorts, Side, Ticks, make_config

KEY = b"k" * 32
WAIT_S = 10.0
TID = TransferId("tx-bound")
STEP_S = 0.25


def _wait_for(condition: Callable[[], bool]) -> bool:
    """Poll until `condition` holds (the listener thread is real); a bound on waiting, not a timed assertion."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def test_a_release_signed_for_rank_0_and_replayed_to_rank_1_is_refused() -> None:
    rank0_port, rank1_hs, rank1_notify = free_loopback_ports(3)
    context: zmq.Context[Any] = zmq.Context()
    rank0 = context.socket(zmq.ROUTER)  # stands for rank 0's listener: it records what reaches it
    rank0.setsockopt(zmq.LINGER, 0)
    rank0.bind(f"tcp://127.0.0.1:{rank0_port}")
    rank1 = Channel("127.0.0.1", rank1_hs, rank1_notify, lambda h, p: True, key=KEY, may_receive_from=lambda h: True)
    consumer = Channel("127.0.0.1", 0, 0, lambda h, p: True, key=KEY)
    replayer = context.socket(zmq.DEALER)
    replayer.setsockopt(zmq.LINGER, 1000)
    try:
        release = ReleaseBlocks(transfer_id=TransferId("tx-replayed"), rank=0, consumer_tp_size=1)
        assert consumer.send("127.0.0.1", rank0_port, release)
        assert rank0.poll(int(WAIT_S * 1000))
        _, recorded = rank0.recv_multipart()
        replayer.connect(f"tcp://127.0.0.1:{rank1_notify}")
        replayer.send(recorded)  # the same bytes, MAC and all, to rank 1
        assert _wait_for(lambda: sum(rank1.counters.values()) >= 1)
        time.sleep(0.05)  # a wrongly accepted message would be counted by now as well
        assert rank1.drain() == [], "rank 1 took a release that was signed for rank 0"
        assert rank1.counters["dropped_wrong_receiver"] == 1
        (dropped,) = rank1.take_dropped()
        assert (dropped.message_type, dropped.transfer_id, dropped.reason) == (
            "release",
            "tx-replayed",
            "wrong_receiver",
        )
        # Sent to rank 1 itself, the same release is taken.
        assert consumer.send("127.0.0.1", rank1_notify, release)
        assert _wait_for(lambda: rank1.counters["received"] == 1)
        (taken,) = rank1.drain()
        assert isinstance(taken, ReleaseBlocks) and taken.transfer_id == "tx-replayed"
    finally:
        replayer.close()
        rank0.close()
        consumer.close()
        rank1.close()
        context.term()


def _leased_pair() -> tuple[Side, Side, EnginePorts]:
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    common: dict[str, Any] = dict(
        defer_timeout_s=2.0, transfer_timeout_s=600.0, recv_abort_timeout_s=1200.0, kv_lease_duration_s=3.0,
        kv_lease_max_s=60.0, control_key=KEY,
    )  # fmt: skip
    producer = Side.build(make_config("producer", "read", prod, cons, **common), fill=True, seed=1)
    consumer = Side.build(make_config("consumer", "read", cons, prod, **common), fill=False, seed=2)
    producer.tick_in_meta = consumer.tick_in_meta = True
    return producer, consumer, prod


def _delivered(sender: Side, receiver: Side) -> None:
    """Wait (bounded) until what `sender` queued reached `receiver`'s listener: the clock decides, not threads."""
    sent = sender.worker.channel.counters["sent"]
    _wait_for(lambda: receiver.worker.channel.counters["received"] >= sent)


def _leases(producer: Side) -> int:
    return sum(1 for e in producer.worker.ledger.log.since() if isinstance(e, Ack) and e.what == "lease")


def test_a_lease_renewal_from_another_key_holder_does_not_hold_the_transfer() -> None:
    producer, consumer, prod = _leased_pair()
    intruder = Channel("127.0.0.1", 0, 0, lambda h, p: True, key=KEY)
    try:
        clock = Ticks(step_s=STEP_S)
        params = parse_params({"transfer_id": TID, "do_remote_decode": True})
        _, kv = producer.scheduler.on_request_finished(ReqId("p-1"), params, (0, 1, 2, 3), clock.now)
        producer.finished_pending.add(ReqId("p-1"))
        consumer.scheduler.on_new_request(ReqId("c-1"), parse_params(kv), clock.now)
        # The real consumer's request waits for a decode slot and renews: its renewal binds the transfer.
        for _ in range(12):
            now = clock()
            consumer.step(now)
            _delivered(consumer, producer)
            producer.step(now)
        renewed = _leases(producer)
        assert renewed >= 1 and producer.worker.counters["lease_renewals"] == renewed
        # Another peer holding the key renews the same transfer in its own name, then in no name at all.
        me = RankAddress(engine_id="intruder", host="127.0.0.1", handshake_port=1, notify_port=2)
        received = producer.worker.channel.counters["received"]
        assert intruder.send("127.0.0.1", prod.notify, LeaseRenew(transfer_ids=(TID,), rank=0, sender=me))
        assert intruder.send("127.0.0.1", prod.notify, LeaseRenew(transfer_ids=(TID,), rank=0))
        assert _wait_for(lambda: producer.worker.channel.counters["received"] == received + 2)
        producer.worker.poll(clock())
        assert _leases(producer) == renewed, "a renewal from a peer the transfer was not handed to held it"
        assert producer.worker.counters["lease_renewals_wrong_consumer"] == 1
        assert producer.worker.counters["lease_renewals_unbound"] == 1
    finally:
        intruder.close()
        producer.close()
        consumer.close()
