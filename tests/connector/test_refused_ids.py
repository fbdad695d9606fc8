"""A refused transfer id (used before on this side) leaves nothing behind in the scheduler core.

The refused map is recorded (the fold files it as an id_reuse finding) but no transfer starts, so nothing
will ever release it: the core must not keep the refused request in its request index (a client that
keeps reusing ids would grow it without bound).
"""

from __future__ import annotations

from pathlib import Path

from kvledger.connector.assemble import build_scheduler
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.events import ReqId, TransferId
from tests.connector.pd import EnginePorts, make_config

T0 = 1_700_000_000.0
TID = TransferId("tx-used-1")


def test_refused_requests_are_not_indexed(tmp_path: Path) -> None:
    p = free_loopback_ports(6)
    mine, theirs = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = build_scheduler(make_config("producer", "read", mine, theirs))
    consumer = build_scheduler(make_config("consumer", "write", theirs, mine))
    params = parse_params({"transfer_id": TID, "do_remote_decode": True})
    assert producer.on_request_finished(ReqId("p-1"), params, (1, 2), T0)[0]
    producer.on_worker_output([ReqId("p-1")], [], [], T0 + 0.1)  # released: its index entry goes
    assert len(producer.index) == 0
    for n in range(2, 12):
        assert producer.on_request_finished(ReqId(f"p-{n}"), params, (1, 2), T0 + n) == (False, None)
    assert len(producer.index) == 0 and not producer.state.live
    assert producer.counters["transfer_id_reused"] == 10

    remote = {"remote_host": "127.0.0.1", "remote_handshake_port": mine.handshake,
              "remote_notify_port": mine.notify, "remote_engine_id": "prefill-0"}  # fmt: skip
    wanted = parse_params({"transfer_id": TID, "do_remote_prefill": True, **remote})
    assert consumer.matched_tokens(wanted, 9, 0) == (9, True)
    assert consumer.on_alloc(ReqId("c-1"), wanted, (5, 6), 8, T0)
    consumer.on_worker_output([], [ReqId("c-1")], [], T0 + 0.2)  # the KV arrived: released
    assert len(consumer.index) == 0
    for n in range(2, 12):
        assert consumer.matched_tokens(wanted, 9, 0) == (0, False)
        assert consumer.on_alloc(ReqId(f"c-{n}"), wanted, (), 0, T0 + n)  # params must say "taken"
    assert len(consumer.index) == 0 and not consumer.state.live
    assert consumer.counters["transfer_id_reused"] == 10
