"""Re-asks and reused transfer ids at the scheduler half: answered from the request's own params and the
fold's single-use rule, never from how long the fold happens to remember a side."""

from __future__ import annotations

from kvledger.connector.params import TransferParams, parse_params, remote_prefill_taken
from kvledger.connector.scheduler import SchedulerCore
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Map, ReqId, TransferId
from kvledger.ledger.ledger import Ledger
from tests.connector.pd import EnginePorts, make_config

PRODUCER_PORTS = EnginePorts(7101, 7201, 7301)
CONSUMER_PORTS = EnginePorts(7401, 7501, 7601)
PROMPT = 200
T = TransferId("tx-reask")


def _consumer(mode: str = "read") -> SchedulerCore:
    config = make_config("consumer", mode, CONSUMER_PORTS, PRODUCER_PORTS, defer_timeout_s=60.0)  # type: ignore[arg-type]
    return SchedulerCore(config, Ledger(config.source(scheduler=True)))


def _producer(mode: str = "read") -> SchedulerCore:
    config = make_config("producer", mode, PRODUCER_PORTS, CONSUMER_PORTS, defer_timeout_s=60.0)  # type: ignore[arg-type]
    return SchedulerCore(config, Ledger(config.source(scheduler=True)))


def _consumer_params(tid: TransferId = T) -> dict[str, object]:
    return {
        "transfer_id": tid,
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_handshake_port": PRODUCER_PORTS.handshake,
        "remote_notify_port": PRODUCER_PORTS.notify,
    }


def _params(raw: dict[str, object]) -> TransferParams:
    params = parse_params(raw)
    assert params is not None
    return params


def _load(core: SchedulerCore, request: str, raw: dict[str, object], now: float) -> tuple[int, bool]:
    """vLLM's order for a waiting request: ask, allocate, tell the connector, keep the params it changed."""
    answer = core.matched_tokens(_params(raw), PROMPT, 0)
    if core.on_alloc(ReqId(request), _params(raw), (5, 6) if answer[0] else (), answer[0], now):
        remote_prefill_taken(raw)
    return answer


def test_a_preempted_request_re_asked_after_its_load_computes_locally_however_late() -> None:
    core = _consumer()
    raw = _consumer_params()
    assert _load(core, "c-1", raw, now=100.0) == (PROMPT, True)
    assert raw["do_remote_prefill"] is False  # the request's own params now say the KV was taken
    core.on_worker_output([], [ReqId("c-1")], [], now=101.0)  # the load finished
    for later in (102.0, 170.0, 3600.0):  # seconds, minutes and an hour later (the side long forgotten)
        core.tick(later)
        assert core.matched_tokens(_params(raw), PROMPT, 0) == (0, False)
        assert core.on_alloc(ReqId("c-1"), _params(raw), (), 0, later) is False
    maps = [e for e in core.ledger.log.since(0) if isinstance(e, Map)]
    assert len(maps) == 1 and not core.state.live


def test_an_id_used_before_is_refused_to_another_request_and_nothing_waits() -> None:
    core = _consumer()
    _load(core, "c-1", _consumer_params(), now=100.0)
    assert [r.request_id for r in core.build_meta().recv] == ["c-1"]
    core.on_worker_output([], [ReqId("c-1")], [], now=101.0)
    core.ledger.maintain(now=1000.0, retain_s=60.0)  # the decided side is compacted
    assert (core.source, T) not in core.state.transfers
    raw = _consumer_params()
    assert _load(core, "c-2", raw, now=1001.0) == (0, False)  # prefills locally
    assert raw["do_remote_prefill"] is False and not core.state.live and not core.build_meta().recv
    findings = [f for f in audit(core.state, now=1001.0) if f.code == "id_reuse"]
    assert len(findings) == 1 and findings[0].request_id == "c-1" and "c-2" in findings[0].detail
    # Nothing was sent to the producer on c-2's behalf: its abort would free c-1's producer blocks.
    assert core.on_request_finished(ReqId("c-2"), _params(raw), (), now=1002.0) == (False, None)
    assert not core.build_meta().abort


def test_a_request_with_nothing_to_load_frees_the_producer_at_once() -> None:
    core = _consumer()
    raw = _consumer_params()
    assert core.on_alloc(ReqId("c-1"), _params(raw), (), 0, now=100.0) is True
    meta = core.build_meta()
    assert [a.transfer_id for a in meta.abort] == [T]
    outcome = core.on_worker_output([], [], [], now=100.0)
    assert outcome.releases[0].why == "aborted_before_allocation" and not outcome.finished_recving


def test_a_producer_refuses_a_used_id_and_holds_nothing_for_it() -> None:
    core = _producer()
    params = _params({"transfer_id": T, "do_remote_decode": True})
    assert core.on_request_finished(ReqId("p-1"), params, (1, 2), now=100.0)[0] is True
    core.on_worker_output([ReqId("p-1")], [], [], now=101.0)  # the consumer released it
    core.ledger.maintain(now=1000.0, retain_s=60.0)
    assert core.on_request_finished(ReqId("p-2"), params, (3, 4), now=1000.0) == (False, None)
    assert not core.has_pending_block_frees() and core.state.blocks_held == 0
    assert [f.code for f in audit(core.state, now=1000.0)] == ["id_reuse"]
    assert core.counters["transfer_id_reused"] == 1


def test_a_write_producer_schedules_no_writes_for_a_used_id() -> None:
    core = _producer("write")
    params = _params(
        {
            "transfer_id": T,
            "do_remote_decode": True,
            "remote_host": "127.0.0.1",
            "remote_handshake_port": CONSUMER_PORTS.handshake,
            "remote_notify_port": CONSUMER_PORTS.notify,
        }
    )
    core.on_save(ReqId("p-1"), params, (1, 2), now=100.0)
    assert len(core.build_meta().save) == 1
    core.on_request_finished(ReqId("p-1"), params, (1, 2), now=100.0)
    core.on_save(ReqId("p-2"), params, (3, 4), now=200.0)
    assert not core.build_meta().save
