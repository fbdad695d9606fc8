"""The consumer's scheduler half renews at a bounded rate, only while its request waits, for a bounded number
of requests; the producer's worker records a renewal only for a side it holds."""

from __future__ import annotations

import pytest

from kvledger.connector import scheduler as scheduler_module
from kvledger.connector.assemble import build_scheduler
from kvledger.connector.config import ConfigError, ConnectorConfig, from_extra_config
from kvledger.connector.limits import LEASE_RENEWALS_PER_LEASE
from kvledger.connector.params import TransferParams, parse_params
from kvledger.connector.scheduler import SchedulerCore
from kvledger.ledger.events import ReqId
from tests.connector.pd import EnginePorts, make_config

PRODUCER = EnginePorts(21100, 21200, 21300)
CONSUMER = EnginePorts(21400, 21500, 21600)
LEASE_S = 6.0
INTERVAL_S = LEASE_S / LEASE_RENEWALS_PER_LEASE


def _consumer(**overrides: object) -> SchedulerCore:
    settings: dict[str, object] = {"kv_lease_duration_s": LEASE_S, **overrides}
    config: ConnectorConfig = make_config("consumer", "read", CONSUMER, PRODUCER, **settings)
    return build_scheduler(config)


def _params(tid: str) -> TransferParams:
    params = parse_params({
        "transfer_id": tid, "do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
        "remote_handshake_port": PRODUCER.handshake, "remote_notify_port": PRODUCER.notify,
        "remote_engine_id": "prefill-0",
    })  # fmt: skip
    assert params is not None
    return params


def _renewed(core: SchedulerCore, now: float) -> list[str]:
    return [item.transfer_id for item in core.build_meta(now).lease]


def test_a_waiting_request_is_renewed_every_sixth_of_a_lease_and_no_faster() -> None:
    core = _consumer()
    core.on_new_request(ReqId("c-1"), _params("tx-1"), 100.0)
    assert _renewed(core, 100.0) == []
    assert _renewed(core, 100.0 + INTERVAL_S / 2) == []
    assert _renewed(core, 100.0 + INTERVAL_S) == ["tx-1"]
    assert _renewed(core, 100.0 + INTERVAL_S * 1.5) == []  # at most one renewal per interval
    assert _renewed(core, 100.0 + INTERVAL_S * 2) == ["tx-1"]


def test_renewals_stop_when_the_request_ends_or_its_receive_is_decided() -> None:
    core = _consumer()
    core.on_new_request(ReqId("c-1"), _params("tx-1"), 100.0)
    core.on_new_request(ReqId("c-2"), _params("tx-2"), 100.0)
    core.on_request_finished(ReqId("c-1"), _params("tx-1"), (), 100.5)  # aborted while it waited
    core.on_alloc(ReqId("c-2"), _params("tx-2"), (7, 8), 16, 100.5)
    core.on_worker_output([], [ReqId("c-2")], [], 100.6)  # its KV arrived
    assert _renewed(core, 100.0 + 10 * INTERVAL_S) == []
    assert core.stats()["leases_renewed_for"] == 0


def test_without_leases_or_for_an_unlisted_peer_nothing_is_renewed() -> None:
    off = _consumer(kv_lease_duration_s=0.0)
    off.on_new_request(ReqId("c-1"), _params("tx-1"), 100.0)
    assert _renewed(off, 200.0) == []
    core = _consumer()
    stranger = parse_params({
        "transfer_id": "tx-x", "do_remote_prefill": True, "remote_block_ids": [1], "remote_host": "127.0.0.1",
        "remote_handshake_port": 1111, "remote_notify_port": 2222,
    })  # fmt: skip
    core.on_new_request(ReqId("c-x"), stranger, 100.0)
    assert _renewed(core, 200.0) == []


def test_the_number_of_renewed_requests_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "LEASES_TRACKED_MAX", 2)
    core = _consumer()
    for i in range(3):
        core.on_new_request(ReqId(f"c-{i}"), _params(f"tx-{i}"), 100.0)
    assert sorted(_renewed(core, 100.0 + INTERVAL_S)) == ["tx-0", "tx-1"]
    assert core.counters["leases_untracked"] == 1


def test_kv_lease_duration_is_read_from_extra_config() -> None:
    base = {"peers": [{"host": "127.0.0.1", "handshake_port": 1, "notify_port": 2, "transport_port": 3}]}

    def config(**extra: object) -> ConnectorConfig:
        return from_extra_config({**base, **extra}, kv_role="kv_consumer", engine_id="decode-0")

    assert config().kv_lease_duration_s == 30.0 and config().leases
    assert config(kv_lease_duration=12).lease_renew_interval_s == 2.0
    assert not config(kv_lease_duration=0).leases
    with pytest.raises(ConfigError, match="kv_lease_duration"):
        config(kv_lease_duration=-1)
