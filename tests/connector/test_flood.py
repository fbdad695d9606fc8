"""A flood from a peer costs each hook a bounded amount of work (issue 36, item 3), over real ZMQ on loopback:
a poll handles POLL_IDS_MAX transfer ids at most however many one message names, and the rest waits for the
next poll, in order, none lost and none handled twice; a lease naming more ids than LEASE_IDS_PER_MESSAGE_MAX
is refused as malformed and counted; releases for ids this rank never mapped open at most UNMAPPED_SIDES_MAX
sides (each an `orphan_ack` the audit reports), and past that are counted, not recorded."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvledger.connector.channel import Channel
from kvledger.connector.limits import LEASE_IDS_PER_MESSAGE_MAX, POLL_IDS_MAX, UNMAPPED_SIDES_MAX
from kvledger.connector.messages import LeaseRenew, Message, RankAddress, ReleaseBlocks
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.audit import AuditConfig, audit
from kvledger.ledger.events import Ack, Expire, ReqId, TransferId
from tests.connector.pd import EnginePorts, Side, make_config

KEY = b"f" * 32
WAIT_S = 20.0
START = 1000.0
HELD = 600
"""Transfers the producer holds: more than one poll's ids, fewer than one lease message's."""
SEND_BATCH = 200
"""Messages sent before waiting for them to arrive (under ZMQ's high-water mark of 1000)."""

LEASE_COUNTERS = ("lease_renewals", "lease_renewals_for_unheld", "lease_renewals_wrong_consumer")


def _wait_for(condition: Callable[[], bool]) -> bool:
    """Poll until `condition` holds (the listener thread is real); a bound on waiting, not a timed assertion."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


class Flood:
    """A READ producer (worker and scheduler halves, leases on) holding HELD transfers, and a consumer's
    channel that floods it with signed control messages."""

    def __init__(self) -> None:
        p = free_loopback_ports(6)
        self.prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
        common: dict[str, Any] = dict(
            defer_timeout_s=600.0, transfer_timeout_s=300.0, recv_abort_timeout_s=1200.0, kv_lease_duration_s=60.0,
            kv_lease_max_s=1200.0, control_key=KEY,
        )  # fmt: skip
        self.producer = Side.build(make_config("producer", "read", self.prod, cons, **common), fill=True, seed=1)
        self.sender = Channel("127.0.0.1", 0, 0, lambda host, port: True, key=KEY)
        self.me = RankAddress(
            engine_id="decode-0", host="127.0.0.1", handshake_port=cons.handshake, notify_port=cons.notify
        )
        self.now = START
        scheduler = self.producer.scheduler
        for i in range(HELD):
            params = parse_params({"transfer_id": f"tx-{i}", "do_remote_decode": True})
            scheduler.on_request_finished(ReqId(f"p-{i}"), params, (i,), self.now)
        self.producer.worker.bind(scheduler.build_meta(self.now), self.now)
        assert len(self.producer.worker.state.live) == HELD

    @property
    def worker(self) -> Any:
        return self.producer.worker

    def send(self, messages: Sequence[Message]) -> None:
        """Send every message and wait (bounded) until the producer's listener queued them all."""
        for start in range(0, len(messages), SEND_BATCH):
            batch = messages[start : start + SEND_BATCH]
            self._send_batch(batch, self.worker.channel.counters["received"] + len(batch))

    def _send_batch(self, batch: Sequence[Message], expected: int) -> None:
        channel = self.worker.channel
        for message in batch:
            assert self.sender.send("127.0.0.1", self.prod.notify, message)
        assert _wait_for(lambda: channel.counters["received"] == expected)

    def poll(self) -> None:
        self.now += 0.01
        self.worker.poll(self.now)

    def events(self) -> list[Any]:
        return list(self.worker.ledger.log.since(0))

    def close(self) -> None:
        self.sender.close()
        self.producer.close()


@pytest.fixture
def flood() -> Iterator[Flood]:
    f = Flood()
    yield f
    f.close()


def _lease(f: Flood, ids: list[str]) -> LeaseRenew:
    return LeaseRenew(transfer_ids=tuple(TransferId(i) for i in ids), rank=0, sender=f.me)


def test_a_flood_of_maximal_lease_messages_is_handled_across_polls_every_id_once(flood: Flood) -> None:
    """Today one poll handles every id of every message it drains: 12,288 in the first hook here."""
    messages = 3
    unheld = messages * LEASE_IDS_PER_MESSAGE_MAX - HELD
    names = [f"tx-{i}" for i in range(HELD)] + [f"unheld-{i}" for i in range(unheld)]
    chunks = [names[k : k + LEASE_IDS_PER_MESSAGE_MAX] for k in range(0, len(names), LEASE_IDS_PER_MESSAGE_MAX)]
    assert [len(c) for c in chunks] == [LEASE_IDS_PER_MESSAGE_MAX] * messages
    after = ReleaseBlocks(transfer_id=TransferId("tx-0"), rank=0, consumer_tp_size=1)
    flood.send([_lease(flood, c) for c in chunks] + [after])
    counters = flood.worker.counters
    handled_per_poll: list[int] = []
    released_at: int | None = None
    for poll in range(len(names) // POLL_IDS_MAX + 4):
        before = sum(counters[name] for name in LEASE_COUNTERS)
        flood.poll()
        handled_per_poll.append(sum(counters[name] for name in LEASE_COUNTERS) - before)
        if released_at is None and ("prefill-0/tp0", TransferId("tx-0")) not in flood.worker.state.live:
            released_at = poll
    assert max(handled_per_poll) == POLL_IDS_MAX, handled_per_poll
    assert sum(handled_per_poll) == len(names), "an id was lost or handled twice"
    assert counters["lease_renewals"] == HELD and counters["lease_renewals_for_unheld"] == len(names) - HELD
    leases = Counter(e.transfer_id for e in flood.events() if isinstance(e, Ack) and e.what == "lease")
    assert leases == Counter({TransferId(f"tx-{i}"): 1 for i in range(HELD)}), "a held transfer not renewed once"
    # The release sent after the leases waited its turn: handled in the poll that finished the last lease.
    assert released_at == len(names) // POLL_IDS_MAX, (released_at, handled_per_poll)


def test_a_lease_naming_more_ids_than_the_bound_is_refused_as_malformed(flood: Flood) -> None:
    """Today a lease of any length is taken whole (one of 20,000 ids held a hook for seconds)."""
    channel = flood.worker.channel
    oversize = _lease(flood, [f"tx-{i % HELD}" for i in range(LEASE_IDS_PER_MESSAGE_MAX + 1)])
    assert flood.sender.send("127.0.0.1", flood.prod.notify, oversize)
    assert _wait_for(lambda: channel.counters["dropped_malformed"] == 1)
    flood.poll()
    assert channel.counters["received"] == 0
    assert not any(isinstance(e, Ack) for e in flood.events()), "a refused lease held a transfer"
    assert flood.worker.counters["lease_renewals"] == 0
    # The bound itself is accepted.
    flood.send([_lease(flood, [f"tx-{i % HELD}" for i in range(LEASE_IDS_PER_MESSAGE_MAX)])])
    for _ in range(LEASE_IDS_PER_MESSAGE_MAX // POLL_IDS_MAX):
        flood.poll()
    assert flood.worker.counters["lease_renewals"] == LEASE_IDS_PER_MESSAGE_MAX


def test_a_flood_of_releases_for_unknown_ids_opens_a_bounded_number_of_sides(flood: Flood) -> None:
    """Today each release for an id never mapped is an event and a side of its own, and each such side expires
    with another event: 20,000 releases were 19,999 events in one flood."""
    unknown = UNMAPPED_SIDES_MAX + 1000
    releases: list[Message] = [
        ReleaseBlocks(transfer_id=TransferId(f"unknown-{i}"), rank=0, consumer_tp_size=1) for i in range(unknown)
    ]
    releases.append(ReleaseBlocks(transfer_id=TransferId("tx-7"), rank=0, consumer_tp_size=1))  # a known one
    flood.send(releases)
    counters = flood.worker.counters
    per_poll: list[int] = []
    for _ in range(len(releases) // POLL_IDS_MAX + 2):
        acks_before = sum(1 for e in flood.events() if isinstance(e, Ack))
        refused_before = counters["unknown_ids_refused"]
        flood.poll()
        acks = sum(1 for e in flood.events() if isinstance(e, Ack)) - acks_before
        per_poll.append(acks + counters["unknown_ids_refused"] - refused_before)
    assert max(per_poll) == POLL_IDS_MAX and sum(per_poll) == len(releases), per_poll
    orphans = [e for e in flood.events() if isinstance(e, Ack) and e.transfer_id.startswith("unknown-")]
    assert len(orphans) == UNMAPPED_SIDES_MAX
    assert counters["unknown_ids_refused"] == unknown - UNMAPPED_SIDES_MAX
    assert ("prefill-0/tp0", TransferId("tx-7")) not in flood.worker.state.live, "a known release was refused"
    # What was recorded stays evidence: each opened side expires once and is an orphan_ack finding.
    timeout = flood.worker.config.transfer_timeout_s
    flood.now += timeout + 1
    flood.poll()
    expired = [e for e in flood.events() if isinstance(e, Expire) and e.transfer_id.startswith("unknown-")]
    assert len(expired) == UNMAPPED_SIDES_MAX
    findings = audit(flood.worker.state, flood.now, AuditConfig(transfer_timeout_s=timeout))
    assert sum(1 for f in findings if f.code == "orphan_ack") == UNMAPPED_SIDES_MAX
    # Expired, they no longer hold the room: the next unknown release is recorded again.
    flood.send([ReleaseBlocks(transfer_id=TransferId("unknown-late"), rank=0, consumer_tp_size=1)])
    flood.poll()
    assert any(isinstance(e, Ack) and e.transfer_id == "unknown-late" for e in flood.events())
