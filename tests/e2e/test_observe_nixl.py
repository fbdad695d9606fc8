"""Observe mode around vLLM's NIXL connector, scheduler side, under vLLM's real `Scheduler`.

`nixl` (NVIDIA's transfer library) is not installable here, and the NIXL worker
(`nixl/base_worker.py`: an agent registering GPU memory, side-channel handshakes,
notifications) is not faked: the tests build NixlConnector's *scheduler* half for
real (vLLM's own code, no nixl needed) and hand vLLM's Scheduler the worker
reports a NIXL worker makes — `finished_recving` when a read completed,
`finished_sending` when the consumer's notification arrived or when the lease
ran out, the latter counted in `NixlKVConnectorStats.num_kv_expired_reqs` as
`_reap_expired_send_leases` does — carried in observe mode's `ObservedStats`, as
an observed worker returns them. The clock is moved by hand (no timed assertion).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from kvledger.cli.app import app
from kvledger.connector.guard import hook_errors
from kvledger.connector.observe.adapter import ObserveConnector, ObservedStats
from kvledger.connector.observe.names import KVLEDGER, WRAPPED, WRAPPED_CONNECTOR
from kvledger.ledger.events import kind_of
from tests.e2e.sched_harness import NUM_BLOCKS, Clock, free_blocks, make_request, make_scheduler, make_vllm_config, step

pytestmark = pytest.mark.vllm

LEASE_S = 5


def _extra(logs: Path) -> dict[str, Any]:
    return {
        "incident_log_dir": str(logs),
        "observe": {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}},
    }


def _expired(count: int) -> ObservedStats:
    """What an observed NIXL worker returns in a step where its lease reaper freed `count` requests."""
    nixl = NixlKVConnectorStats()
    nixl.data["num_kv_expired_reqs"].extend([1] * count)
    return ObservedStats(data={WRAPPED: nixl, KVLEDGER: None, WRAPPED_CONNECTOR: "NixlConnector"})


def _pair(model: str, logs: Path) -> tuple[Any, Any]:
    producer = make_scheduler(make_vllm_config(model, "kv_producer", _extra(logs)))
    consumer = make_scheduler(make_vllm_config(model, "kv_consumer", _extra(logs)))
    assert isinstance(producer.connector, ObserveConnector) and isinstance(consumer.connector, ObserveConnector)
    assert type(producer.connector.wrapped).__name__ == "NixlPullConnector"
    return producer, consumer


def _prefill(producer: Any) -> tuple[str, dict[str, Any]]:
    """One prompt prefilled on the producer: NIXL holds its blocks and names them in the params it returns."""
    request = make_request(40, {"do_remote_decode": True}, max_tokens=1)
    producer.add_request(request)
    _, outputs = step(producer)
    (out,) = outputs[0].outputs
    assert out.kv_transfer_params["remote_request_id"] == request.request_id
    assert free_blocks(producer) < NUM_BLOCKS - 1  # NIXL delayed the free
    return request.request_id, dict(out.kv_transfer_params)


def _audit(logs: Path) -> str:
    result = CliRunner().invoke(app, ["audit", *map(str, sorted(logs.glob("*.jsonl")))])
    return result.output


def test_lease_expiry_before_the_read_is_a_premature_release(model: str, tmp_path: Path, clock: Clock) -> None:
    producer, consumer = _pair(model, tmp_path)
    producer_req, params = _prefill(producer)
    request = make_request(40, params, max_tokens=3)
    consumer.add_request(request)
    step(consumer)  # NIXL answers (40, True): the request waits for its remote KV; blocks allocated
    assert request.request_id in consumer.requests and not request.kv_transfer_params["do_remote_prefill"]

    clock.now += LEASE_S + 1  # the decode side is slow: NIXL's producer worker reaps the lease
    step(producer, finished_sending={producer_req}, kv_connector_stats=_expired(1))
    assert free_blocks(producer) == NUM_BLOCKS - 1  # vLLM freed the producer's blocks (NIXL's decision)

    clock.now += 1  # ... and the read completes afterwards, from blocks the producer no longer holds
    step(consumer, finished_recving={request.request_id})
    producer.connector.shutdown()
    consumer.connector.shutdown()

    kinds = [kind_of(e) for e in producer.connector.recorder.ledger.log.since(0)]
    assert kinds == ["map", "expire"]
    report = _audit(tmp_path)
    assert "premature_release" in report, report


def test_release_by_the_consumer_is_recorded_once_without_finding(model: str, tmp_path: Path, clock: Clock) -> None:
    producer, consumer = _pair(model, tmp_path)
    producer_req, params = _prefill(producer)
    request = make_request(40, params, max_tokens=3)
    consumer.add_request(request)
    step(consumer)
    clock.now += 1
    step(consumer, finished_recving={request.request_id})  # read done; NIXL's consumer notifies the producer
    step(producer, finished_sending={producer_req})  # the notification frees the producer, before its lease
    assert free_blocks(producer) == NUM_BLOCKS - 1
    for _ in range(3):
        step(consumer)
    producer.connector.shutdown()
    consumer.connector.shutdown()

    producer_events = [(kind_of(e), e.transfer_id) for e in producer.connector.recorder.ledger.log.since(0)]
    consumer_events = [(kind_of(e), e.transfer_id) for e in consumer.connector.recorder.ledger.log.since(0)]
    assert producer_events == [("map", producer_req), ("ack", producer_req)]
    assert consumer_events == [("map", producer_req), ("ack", producer_req)]  # NIXL's id: the producer's request
    assert "no findings" in _audit(tmp_path)


def test_a_recording_failure_never_reaches_vllm(model: str, tmp_path: Path, clock: Clock, monkeypatch: Any) -> None:
    producer, _ = _pair(model, tmp_path)
    recorder = producer.connector.recorder

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(recorder, "on_request_finished", broken)
    before = hook_errors["_after_finished"]
    producer_req, params = _prefill(producer)  # NIXL's answer still reached vLLM: blocks held, params returned
    assert params["remote_block_ids"]
    assert hook_errors["_after_finished"] == before + 1
    step(producer, finished_sending={producer_req})
    assert free_blocks(producer) == NUM_BLOCKS - 1


def test_a_restarted_engine_fails_what_its_previous_process_held(model: str, tmp_path: Path, clock: Clock) -> None:
    """With a store (`ledger_url`), a restarted observer reloads its log and, as the connector's own mode
    does, fails the sides the dead process held: its requests and their blocks died with it (no leak)."""
    extra = {**_extra(tmp_path / "logs"), "ledger_url": f"sqlite:///{tmp_path / 'ledger.db'}"}
    first = make_scheduler(make_vllm_config(model, "kv_producer", extra))
    _prefill(first)
    first.connector.shutdown()
    again = make_scheduler(make_vllm_config(model, "kv_producer", extra))
    ledger = again.connector.recorder.ledger
    assert not ledger.state.live
    assert [kind_of(e) for e in ledger.log.since(0)][-1] == "fail"
    again.connector.shutdown()


def test_a_consumer_stuck_waiting_for_its_kv_is_a_leak_in_vllms_stats(model: str, tmp_path: Path, clock: Clock) -> None:
    """Decode requests stuck in WAITING_FOR_REMOTE_KVS (the read never completes nor fails): once the
    consumer's transfer deadline passes, the stats vLLM publishes carry a `leak` finding, and the blocks held."""
    producer, consumer = _pair(model, tmp_path)
    _, params = _prefill(producer)
    consumer.add_request(make_request(40, params, max_tokens=3))
    _, outputs = step(consumer)
    figures = outputs[0].scheduler_stats.kv_connector_stats[KVLEDGER]
    assert figures["requests_held"] == 1 and figures["blocks_held"] == 3 and not figures["findings"]
    clock.now += 31  # past the consumer's transfer_timeout (30 s by default)
    _, outputs = step(consumer)
    figures = outputs[0].scheduler_stats.kv_connector_stats[KVLEDGER]
    assert figures["findings"] == {"leak": 1}
    assert figures["requests_held"] == 1  # NIXL keeps every decision: the observer frees nothing
