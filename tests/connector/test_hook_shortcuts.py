"""The scheduler hooks' shortcuts (issue 19) give the answers of the longer way: params parsed strictly
first, the consumer's params from a template, the producer's hold taken once, events built with their seq."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.params import ConsumerParams, ParamsError, TransferParams, consumer_params, parse_params
from kvledger.connector.scheduler import SchedulerCore
from kvledger.ledger.events import UNASSIGNED_SEQ, ReqId, TransferId
from kvledger.ledger.fold import fold_all
from kvledger.ledger.ledger import Ledger
from tests.connector.pd import EnginePorts, make_config

PRODUCER_PORTS = EnginePorts(7111, 7211, 7311)
CONSUMER_PORTS = EnginePorts(7411, 7511, 7611)


@pytest.mark.parametrize(
    "raw",
    [
        {"transfer_id": "tx-1", "do_remote_decode": True},
        {"transfer_id": "tx-2", "do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_block_groups": [2]},
        {"transfer_id": "tx-3", "remote_host": "10.0.0.1", "remote_handshake_port": "7001", "remote_notify_port": 7002},
        {"transfer_id": "tx-4", "do_remote_decode": "true", "remote_tp_size": 2.0},
        {"transfer_id": "null", "remote_host": "null", "remote_engine_id": "1"},
    ],
    ids=["well typed", "blocks and groups", "port as text", "bool as text, int as float", "text that reads as null"],
)
def test_params_parse_as_the_lax_conversion_alone_would(raw: dict[str, Any]) -> None:
    assert parse_params(raw) == msgspec.convert(dict(raw), TransferParams, strict=False)


def test_params_that_no_conversion_takes_name_the_field() -> None:
    with pytest.raises(ParamsError, match=r"kv_transfer_params: .*\$\.remote_notify_port"):
        parse_params({"transfer_id": "tx-1", "remote_notify_port": "seven"})


def _literal(transfer_id: str, blocks: tuple[int, ...], config: ConnectorConfig) -> dict[str, Any]:
    """The consumer's params as a literal, in the order the proxy has always received them."""
    a = config.address
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_block_ids": list(blocks),
        "remote_engine_id": a.engine_id,
        "remote_host": a.host,
        "remote_handshake_port": a.handshake_port,
        "remote_notify_port": a.notify_port,
        "remote_tp_size": a.tp_size,
        "remote_dp_rank": a.dp_rank,
    }


def test_consumer_params_from_the_template_are_the_literal_in_its_order() -> None:
    config = make_config("producer", "read", PRODUCER_PORTS, CONSUMER_PORTS, tp_size=2, dp_rank=1)
    build = ConsumerParams(config.address)
    first = build(TransferId("tx-1"), (1, 2))
    second = build(TransferId("tx-2"), (3,), block_groups=(1,))
    first["remote_block_ids"].append(99)  # a caller's edit reaches neither the template nor the next params
    third = build(TransferId("tx-3"), (4, 5))
    assert list(first.items()) == list(_literal("tx-1", (1, 2, 99), config).items())
    assert list(second.items()) == [("remote_block_groups", [1]), *_literal("tx-2", (3,), config).items()]
    assert list(third.items()) == list(_literal("tx-3", (4, 5), config).items())
    assert consumer_params(TransferId("tx-3"), (4, 5), config.address) == third


@pytest.mark.parametrize(
    ("lease_s", "held_s"),
    [(0.0, 60.0), (5.0, 60.0), (600.0, 600.0)],
    ids=["leases off", "lease under defer", "lease over defer"],
)
def test_the_producer_hold_taken_once_is_the_deadline_rule(lease_s: float, held_s: float) -> None:
    """The scheduler half holds for defer_timeout, or kv_lease_max with leases on when longer; a worker for
    defer_timeout (its renewals move it)."""
    config = make_config(
        "producer",
        "read",
        PRODUCER_PORTS,
        CONSUMER_PORTS,
        defer_timeout_s=60.0,
        kv_lease_duration_s=lease_s,
        kv_lease_max_s=lease_s or 1.0,
    )
    assert config.producer_deadline(1000.5, scheduler=True) == 1000.5 + held_s
    assert config.producer_deadline(1000.5, scheduler=False) == 1000.5 + 60.0
    core = SchedulerCore(config, Ledger(config.source(scheduler=True)))
    params = parse_params({"transfer_id": "tx-1", "do_remote_decode": True})
    core.on_request_finished(ReqId("p-1"), params, (1, 2), 1000.5)
    (mapped,) = core.state.live.values()
    assert mapped.deadline == 1000.5 + held_s


def _gapless_and_refolds(core: SchedulerCore) -> None:
    events = list(core.ledger.log.since(0))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    unstamped = [msgspec.structs.replace(e, seq=UNASSIGNED_SEQ) for e in events]
    again = Ledger(core.source)
    again.extend(unstamped)
    assert list(again.log.since(0)) == events  # built with their seq, stored as the log would have stamped them
    state, _ = fold_all(events)
    assert state.live.keys() == core.state.live.keys()
    assert state.releases_by_cause == core.state.releases_by_cause


def test_a_producers_events_carry_the_seqs_the_log_would_give() -> None:
    config = make_config("producer", "read", PRODUCER_PORTS, CONSUMER_PORTS, defer_timeout_s=1.0)
    core = SchedulerCore(config, Ledger(config.source(scheduler=True)))
    for i in range(4):
        params = parse_params({"transfer_id": f"tx-{i}", "do_remote_decode": True})
        core.on_request_finished(ReqId(f"p-{i}"), params, (2 * i, 2 * i + 1), 1000.0)
    reused = parse_params({"transfer_id": "tx-0", "do_remote_decode": True})
    assert core.on_request_finished(ReqId("p-again"), reused, (9,), 1000.0) == (False, None)
    core.build_meta(1000.0)
    out = core.on_worker_output([ReqId("p-0"), ReqId("p-1"), ReqId("p-unknown")], (), (), 1000.1)
    assert out.finished_sending == {"p-0", "p-1"}
    due = config.producer_deadline(1000.0, scheduler=True) + 0.5
    out = core.on_worker_output((), (), (), due)  # the others expire at their deadline
    assert out.finished_sending == {"p-2", "p-3"}
    stats = core.stats()
    assert list(stats)[-2:] == ["count_transfer_id_reused", "count_unknown_request"]
    assert stats["events"] == core.ledger.log.next_seq - 1
    _gapless_and_refolds(core)


def test_a_consumers_events_carry_the_seqs_the_log_would_give() -> None:
    config = make_config("consumer", "read", CONSUMER_PORTS, PRODUCER_PORTS)
    core = SchedulerCore(config, Ledger(config.source(scheduler=True)))
    assert list(core.stats()) == ["live", "blocks_held", "released", "leases_renewed_for", "events"]
    base = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "prefill-0"}
    known = {"remote_host": "127.0.0.1", "remote_handshake_port": PRODUCER_PORTS.handshake}
    ok = parse_params({"transfer_id": "tx-ok", **base, **known, "remote_notify_port": PRODUCER_PORTS.notify})
    stranger = parse_params({"transfer_id": "tx-x", **base, **known, "remote_notify_port": 9})
    aborted = parse_params({"transfer_id": "tx-ab", **base, **known, "remote_notify_port": PRODUCER_PORTS.notify})
    assert core.on_alloc(ReqId("c-ok"), ok, (5, 6), 8, 1000.0)
    assert core.on_alloc(ReqId("c-x"), stranger, (7, 8), 8, 1000.0)  # a peer outside the allow-list: failed
    core.on_request_finished(ReqId("c-ab"), aborted, (), 1000.0)  # ended before its allocation
    core.build_meta(1000.0)
    out = core.on_worker_output((), [ReqId("c-ok"), ReqId("c-x")], [ReqId("c-ok"), ReqId("c-x")], 1000.1)
    assert out.failed_recving == {"c-ok", "c-x"}
    _gapless_and_refolds(core)
