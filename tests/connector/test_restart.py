"""A restarted engine (ledgers reopened from `ledger_url`) inherits the sides that were live when it died.

Their requests died with the old process: the new one must never report them to vLLM (vLLM asserts
`req_id in self.requests` for every id in finished_sending / finished_recving), must not count their
blocks as held (they collide with its new requests' blocks), and must still refuse their transfer ids.
"""

from __future__ import annotations

from pathlib import Path

from kvledger.connector.assemble import build_scheduler, build_worker
from kvledger.connector.config import ConnectorConfig
from kvledger.connector.metadata import StepMetadata
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.connector.reasons import REASON_ENGINE_RESTARTED
from kvledger.connector.scheduler import SchedulerCore
from kvledger.connector.store import open_ledger
from kvledger.ledger.events import Fail, ReqId, TransferId
from tests.connector.pd import EnginePorts, make_config

T0 = 1_700_000_000.0
TID = TransferId("tx-restart-1")


def _configs(url: str) -> tuple[ConnectorConfig, ConnectorConfig]:
    p = free_loopback_ports(6)
    mine, theirs = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = make_config("producer", "read", mine, theirs, ledger_url=url)
    consumer = make_config("consumer", "read", theirs, mine, ledger_url=url)
    return producer, consumer


def _producer_maps(core: SchedulerCore, request: str, tid: TransferId, now: float) -> tuple[bool, object]:
    params = parse_params({"transfer_id": tid, "do_remote_decode": True})
    return core.on_request_finished(ReqId(request), params, (3, 4), now)


def test_a_restarted_producer_reports_nothing_it_did_not_take_and_holds_nothing(tmp_path: Path) -> None:
    producer, _ = _configs(f"sqlite:///{tmp_path}/ledger.db")
    first = build_scheduler(producer)
    keep, _ = _producer_maps(first, "p-1", TID, T0)
    assert keep and first.state.blocks_held == 2
    first.ledger.close()  # the process dies with p-1's blocks held for a remote decode

    again = build_scheduler(producer)  # a new process: vLLM has never heard of p-1
    assert not again.state.live and again.state.blocks_held == 0
    assert not again.has_pending_block_frees()
    last = list(again.ledger.log.since(0))[-1]
    assert isinstance(last, Fail) and last.transfer_id == TID and last.reason == REASON_ENGINE_RESTARTED
    # Past p-1's defer deadline, the first update_connector_output: nothing to report to this vLLM.
    outcome = again.on_worker_output([], [], [], T0 + 10 * producer.defer_timeout_s)
    assert outcome.finished_sending == set() and outcome.releases == []
    # The transfer id stays used: a new request naming it is refused (vLLM frees its blocks at once).
    assert _producer_maps(again, "p-2", TID, T0 + 11 * producer.defer_timeout_s) == (False, None)
    # New requests map as usual, on block ids the dead process's request held.
    keep, _ = _producer_maps(again, "p-3", TransferId("tx-restart-2"), T0 + 12 * producer.defer_timeout_s)
    assert keep and again.state.blocks_held == 2 and not again.state.double_owned
    again.ledger.close()


def test_a_restarted_consumer_worker_drops_what_it_was_loading(tmp_path: Path) -> None:
    producer, consumer = _configs(f"sqlite:///{tmp_path}/ledger.db")
    scheduler = build_scheduler(consumer)
    raw = {"transfer_id": TID, "do_remote_prefill": True, "remote_block_ids": [1, 2], **_remote(producer)}
    params = parse_params(raw)
    assert scheduler.matched_tokens(params, 9, 0) == (9, True)
    assert scheduler.on_alloc(ReqId("c-1"), params, (5, 6), 8, T0)
    worker = build_worker(consumer)
    worker.bind(scheduler.build_meta(), T0)
    assert worker.state.live
    worker.close()
    scheduler.ledger.close()

    scheduler, worker = build_scheduler(consumer), build_worker(consumer)
    try:
        assert not scheduler.state.live and not worker.state.live and worker.state.blocks_held == 0
        worker.bind(StepMetadata(), T0 + 100)
        sending, recving, failed = worker.get_finished([], T0 + 100)
        assert (sending, recving, failed) == (set(), set(), set())
        outcome = scheduler.on_worker_output(sorted(recving), [], [], T0 + 100)
        assert outcome.finished_recving == set() and outcome.invalid_block_ids == set()
        assert scheduler.matched_tokens(params, 9, 0) == (0, False)  # used before the restart: refused
    finally:
        worker.close()
        scheduler.ledger.close()


def _remote(producer: ConnectorConfig) -> dict[str, object]:
    return {
        "remote_host": producer.host,
        "remote_handshake_port": producer.handshake_port,
        "remote_notify_port": producer.notify_port,
        "remote_engine_id": producer.engine_id,
    }


def test_a_restart_holds_no_more_sides_than_the_running_ledger_did(tmp_path: Path) -> None:
    """Hours of history reopen into what a running ledger keeps: recent sides whole, older ones as tombstones
    within the bound, the oldest in the id memory; every id used before is still refused."""
    producer, _ = _configs(f"sqlite:///{tmp_path}/ledger.db")
    tombstones_max, sides = 16, 400
    first = build_scheduler(producer)
    for i in range(sides):  # one transfer every 30 s: more than three hours of log
        now = T0 + 30.0 * i
        assert _producer_maps(first, f"p-{i}", TransferId(f"tx-{i}"), now)[0]
        first.on_worker_output([ReqId(f"p-{i}")], [], [], now + 0.5)  # the consumer's release
    whole_before = len(first.state.transfers)  # what maintenance left whole (the last few minutes)
    assert whole_before < 10
    first.ledger.close()

    again = open_ledger(producer, producer.source(scheduler=True), tombstones_max=tombstones_max)
    state = again.state
    assert state.tombstones_max == tombstones_max
    assert len(state.transfers) <= whole_before and state.tombstone_count < tombstones_max
    assert state.tombstones_evicted >= sides - tombstones_max - 2
    for i in (0, sides // 2, sides - 1):
        assert state.was_mapped((again.source, TransferId(f"tx-{i}")))
    again.close()
