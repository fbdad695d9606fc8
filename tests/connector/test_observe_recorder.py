"""Observe mode's recorder (vLLM-free): what a wrapped connector did becomes the events the audits read."""

from __future__ import annotations

import pytest

from kvledger.connector.config import ConfigError
from kvledger.connector.observe.config import observe_config
from kvledger.connector.observe.keys import MORIIO, NIXL, ParamsKeys, keys_for
from kvledger.connector.observe.recorder import REASON_FAILED_RECVING, Recorder
from kvledger.ledger.events import ReqId, TransferId, kind_of
from kvledger.ledger.ledger import Ledger

HOLD_S = 10.0


def recorder(keys: ParamsKeys = MORIIO) -> Recorder:
    return Recorder(Ledger("e/sched"), keys, hold_s=HOLD_S, transfer_timeout_s=30.0)


def kinds(r: Recorder) -> list[str]:
    return [kind_of(e) for e in r.ledger.log.since(0)]


def test_a_delayed_producer_free_is_held_until_finished_sending() -> None:
    r = recorder()
    params = {"do_remote_decode": True, "transfer_id": "tx-1"}
    r.on_request_finished(ReqId("p1"), params, True, True, (4, 5), None, 100.0)
    assert r.state.blocks_held == 2
    r.on_output({"p1"}, (), (), (), None, 101.0)
    assert kinds(r) == ["map", "ack"] and r.state.blocks_held == 0
    assert r.state.releases_by_cause["completed"] == 1


def test_a_producer_not_delayed_is_not_recorded() -> None:
    r = recorder()
    r.on_request_finished(ReqId("p1"), {"do_remote_decode": True, "transfer_id": "tx-1"}, False, False, (4,), None, 1.0)
    assert kinds(r) == []


@pytest.mark.parametrize(("reported", "kind"), [(1, "expire"), (0, "ack"), (None, "expire")])
def test_expiry_needs_the_passed_hold_time_and_the_connector_saying_so(reported: int | None, kind: str) -> None:
    r = recorder()
    r.on_request_finished(ReqId("p1"), {"do_remote_decode": True, "transfer_id": "tx-1"}, True, True, (4,), None, 0.0)
    r.on_output({"p1"}, (), (), (), reported, HOLD_S + 1)
    assert kinds(r)[-1] == kind


def test_a_send_before_the_hold_time_is_never_an_expiry() -> None:
    r = recorder()
    r.on_request_finished(ReqId("p1"), {"do_remote_decode": True, "transfer_id": "tx-1"}, True, True, (4,), None, 0.0)
    r.on_output({"p1"}, (), (), (), 5, HOLD_S - 1)
    assert kinds(r)[-1] == "ack"


def test_consumer_completion_failure_and_load_errors() -> None:
    r = recorder()
    for n, request in enumerate(("c1", "c2", "c3")):
        params = {"do_remote_prefill": True, "transfer_id": f"tx-{n}"}
        r.on_alloc(ReqId(request), params, (10 * n + 1, 10 * n + 2), None, 256, 1.0)
    r.on_output((), {"c1", "c2"}, {"c2"}, {21}, None, 2.0)
    events = {e.transfer_id: kind_of(e) for e in r.ledger.log.since(3)}
    assert events == {TransferId("tx-0"): "ack", TransferId("tx-1"): "fail", TransferId("tx-2"): "fail"}
    fails = [e for e in r.ledger.log.since(3) if kind_of(e) == "fail"]
    assert REASON_FAILED_RECVING in {getattr(e, "reason", "") for e in fails}
    assert r.state.releases_by_cause == {"completed": 1, "failed": 2, "expired": 0}


def test_a_consumer_finished_while_waiting() -> None:
    r = recorder()
    r.on_alloc(ReqId("c1"), {"do_remote_prefill": True, "transfer_id": "a"}, (1,), None, 128, 1.0)
    r.on_alloc(ReqId("c2"), {"do_remote_prefill": True, "transfer_id": "b"}, (2,), None, 128, 1.0)
    r.on_request_finished(ReqId("c1"), {}, False, False, (1,), None, 2.0)  # aborted
    r.on_request_finished(ReqId("c2"), {}, True, False, (2,), None, 2.0)  # a synchronous load that ran
    assert kinds(r)[2:] == ["fail", "ack"]
    assert r.state.releases_by_cause == {"completed": 1, "failed": 1, "expired": 0}


def test_no_external_tokens_or_no_transfer_id_records_nothing() -> None:
    r = recorder()
    r.on_alloc(ReqId("c1"), {"do_remote_prefill": True, "transfer_id": "a"}, (1,), None, 0, 1.0)
    r.on_alloc(ReqId("c2"), {"do_remote_prefill": True}, (1,), None, 128, 1.0)
    assert kinds(r) == [] and r.counters["params_without_transfer_id"] == 1


def test_a_reused_transfer_id_is_an_id_reuse_finding_and_holds_nothing() -> None:
    r = recorder()
    params = {"do_remote_prefill": True, "transfer_id": "a"}
    r.on_alloc(ReqId("c1"), params, (1,), None, 128, 1.0)
    r.on_alloc(ReqId("c2"), params, (2,), None, 128, 1.0)
    assert r.counters["transfer_id_reused"] == 1 and r.state.blocks_held == 1


def test_nixl_names_a_transfer_by_the_producers_request_id() -> None:
    assert NIXL.producer_transfer_id(ReqId("req-7"), {"do_remote_decode": True}) == "req-7"
    assert NIXL.consumer_transfer_id({"remote_request_id": "req-7"}) == "req-7"
    assert NIXL.remote_blocks({"remote_block_ids": [[1, 2], [3]]}) == (1, 2, 3)
    assert NIXL.hold_s({"kv_lease_duration": 12}) == 12.0


def test_an_unknown_connector_is_read_by_the_configured_key() -> None:
    keys = keys_for("SomeoneElsesConnector", "xfer")
    assert keys.consumer_transfer_id({"xfer": "t-1"}) == "t-1"
    assert keys.producer_transfer_id(ReqId("r"), {"xfer": "t-1"}) == "t-1"
    assert keys_for("MooncakeConnector").consumer_id_key == "transfer_id"


def test_observe_config_is_validated_at_start() -> None:
    assert observe_config({}) is None
    config = observe_config({"observe": {"kv_connector": "NixlConnector", "kv_connector_extra_config": {}}})
    assert config is not None and config.keys is NIXL
    for bad in ({"kv_connector": ""}, {"kv_connector": "LedgerConnector"}, "NixlConnector",
                {"kv_connector": "X", "transfer_id_key": ""}):  # fmt: skip
        with pytest.raises(ConfigError):
            observe_config({"observe": bad})
