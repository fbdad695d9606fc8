"""The in-memory log: gapless seqs under concurrent appends, listeners in order, retention."""

from __future__ import annotations

import threading

import pytest

from kvledger.ledger.events import Ack, Event, TransferId
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.log import EventLog, SeqError
from tests.ledger.builders import Side


def _ack(source: str, i: int) -> Ack:
    return Ack(ts=float(i), source=source, transfer_id=TransferId(f"tx-{i}"), what="recv")


def test_concurrent_appends_get_gapless_seqs_and_listeners_see_log_order() -> None:
    log = EventLog("decode-0/tp0")
    seen: list[int] = []
    log.subscribe(lambda e: seen.append(e.seq))
    threads_n, per_thread = 8, 2000

    def work(k: int) -> None:
        for i in range(per_thread):
            log.append(_ack("decode-0/tp0", k * per_thread + i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = threads_n * per_thread
    assert [e.seq for e in log.since(0)] == list(range(1, total + 1))
    assert seen == list(range(1, total + 1))
    assert sorted(e.transfer_id for e in log.since(0)) == sorted(f"tx-{i}" for i in range(total))


def test_append_rejects_a_wrong_seq_or_source_and_extend_is_all_or_nothing() -> None:
    log = EventLog("p")
    log.append(_ack("p", 0))
    with pytest.raises(SeqError, match="expects 2"):
        log.append(Ack(seq=5, ts=1.0, source="p", transfer_id=TransferId("t"), what="recv"))
    with pytest.raises(ValueError, match="source 'q'"):
        log.append(_ack("q", 1))
    good = Ack(seq=2, ts=1.0, source="p", transfer_id=TransferId("t"), what="recv")
    bad = Ack(seq=9, ts=1.0, source="p", transfer_id=TransferId("t"), what="recv")
    with pytest.raises(SeqError):
        log.extend([good, bad])
    assert log.next_seq == 2 and len(log) == 1


def test_since_and_retention_keep_seqs_gapless() -> None:
    log = EventLog("p")
    log.extend(_ack("p", i) for i in range(10))
    assert [e.seq for e in log.since(7)] == [8, 9, 10]
    assert log.retain_from(6) == 5
    assert log.first_seq == 6 and len(log) == 5
    assert [e.seq for e in log.since(0)] == [6, 7, 8, 9, 10]
    assert log.append(_ack("p", 11)).seq == 11


def test_unsubscribe_stops_the_listener() -> None:
    log = EventLog("p")
    seen: list[Event] = []
    stop = log.subscribe(seen.append)
    log.append(_ack("p", 1))
    stop()
    log.append(_ack("p", 2))
    assert [e.seq for e in seen] == [1]


def test_ledger_folds_under_the_log_lock_and_hands_each_release_out_once() -> None:
    clock = iter(float(i) for i in range(100))
    ledger = Ledger("prefill-0/tp0", clock=lambda: next(clock))
    from kvledger.ledger.events import Map, ReqId

    event, release = ledger.record(
        Map, transfer_id=TransferId("tx"), request_id=ReqId("p-1"), role="producer", mode="read",
        block_ids=(1, 2), deadline=50.0, acks_expected=1,
    )  # fmt: skip
    assert event.seq == 1 and event.ts == 0.0 and release is None
    _, release = ledger.record(Ack, transfer_id=TransferId("tx"), what="release")
    assert release is not None and release.request_id == "p-1"
    assert ledger.take_releases() == [release]
    assert ledger.take_releases() == []
    side = Side("prefill-0/tp0")
    side.seq = 2
    assert ledger.extend([side.map("tx2", "p-2", blocks=(3,)), side.ack("tx2", "release")])[0].block_ids == (3,)


def test_maintain_forgets_old_decided_sides_and_trims_the_log(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvledger.ledger.ledger as ledger_module

    monkeypatch.setattr(ledger_module, "LOG_EVENTS_RETAINED_MAX", 3)
    ledger = Ledger("prefill-0/tp0")
    side = Side("prefill-0/tp0", start_ts=100.0)
    ledger.extend([side.map("tx-old", "p-1", blocks=(1,)), side.ack("tx-old", "release")])
    side.ts = 200.0
    ledger.extend([side.map("tx-live", "p-2", blocks=(2,)), side.map("tx-new", "p-3", blocks=(3,))])
    ledger.append(side.ack("tx-new", "release"))
    assert ledger.maintain(now=210.0, retain_s=60.0) == 1  # tx-old decided at ~100: forgotten
    assert set(ledger.state.transfers) == {("prefill-0/tp0", "tx-live"), ("prefill-0/tp0", "tx-new")}
    assert [e.seq for e in ledger.log.since(0)] == [3, 4, 5]
    assert ledger.maintain(now=211.0, retain_s=0.0) == 0  # rate-limited
    assert ledger.append(side.ack("tx-old", "release", rank=1)) is None  # late, not an orphan
    recalled = ledger.state.transfers[("prefill-0/tp0", "tx-old")]
    assert recalled.closed and recalled.late_seqs == [6] and not ledger.state.unmapped
