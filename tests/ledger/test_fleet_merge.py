"""The service's merge of partition workers' answers (`kvledger.ledger.fleet.LiveMerge`), sans-IO: partitions
fed a stream's events a few messages at a time and asked again and again, each answer telling its merge items
once (taken), or those after what the merge was told (`since`: a merge started again is told everything), or
again after a restart from a saved fold, merge into what one fold of the stream says."""

from __future__ import annotations

import random

import msgspec

from kvledger.ledger.audit import audit, found_at
from kvledger.ledger.events import KIND_OF_TYPE, KINDS, Event, Map
from kvledger.ledger.fleet import (
    LiveMerge,
    PartitionFold,
    SidesAsked,
    _request_sides,
    _sides,
    merge_pages,
    merge_request_sides,
)
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.merge import batched
from kvledger.ledger.partition import partition_of, partition_of_event
from kvledger.ledger.partitioned import PartitionAnswer
from kvledger.ledger.picture import merge_pictures, picture_of
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.store.partition_source import Delivered
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, history

PARTITIONS = 4


def _messages(events: list[Event]) -> list[tuple[int, int, list[tuple[int, Event]]]]:
    """(stream seq, partition, rows) of each message: 5 events of one partition, cursors as the NATS store's."""
    out: list[tuple[int, int, list[tuple[int, Event]]]] = []
    for chunk in batched(events, 5):
        groups: dict[int, list[Event]] = {}
        for e in chunk:
            groups.setdefault(partition_of_event(e, PARTITIONS), []).append(e)
        for p, members in groups.items():
            seq = len(out) + 1
            out.append((seq, p, [(seq << 16 | i, e) for i, e in enumerate(members, 1)]))
    return out


def _answers(folds: dict[int, PartitionFold], merge: LiveMerge, now: float, kept: bool) -> list[PartitionAnswer]:
    if not kept:
        return [f.answer(now) for f in folds.values()]
    return [f.answer(now, since=merge.told[p]) for p, f in folds.items()]


def test_answers_asked_again_and_again_merge_into_one_fold() -> None:
    events = history(5, Shape(transfers=80, span_s=200.0, block_pool=8, reuse_rate=0.2, orphan_rate=0.1,
                              consumers=("decode-0/tp0", "decode-1/tp0")))  # fmt: skip
    messages = _messages(events)
    stored = [e for _, _, rows in messages for _, e in rows]
    now = max(e.ts for e in stored) + 1.0
    expected = audit(replay_chunks(batched(stored, 64)).state, now)
    assert any(f.code == "double_owner" for f in expected)
    rng = random.Random(3)
    for kept in (False, True):
        folds = {p: PartitionFold(p, PARTITIONS) for p in range(PARTITIONS)}
        merge = LiveMerge(PARTITIONS, range(PARTITIONS))
        saved = {p: f.encode() for p, f in folds.items()}
        last = 0
        for seq, p, rows in messages:
            folds[p].apply(Delivered(p, rows, seq, seq, 0))
            for other in folds.values():  # every partition complete through this message
                other.apply(Delivered(other.partition, [], 0, seq, 0))
            last = seq
            if rng.random() < 0.1:
                merge.add(_answers(folds, merge, now, kept))
            if kept and rng.random() < 0.02:  # the service started again: a new merge, told everything
                merge = LiveMerge(PARTITIONS, range(PARTITIONS))
            if rng.random() < 0.05:  # a worker started again from its last save folds again what followed
                restarted = PartitionFold.decode(saved[p])
                for s, q, again in messages[:seq]:
                    if q == p and s > restarted.applied:
                        restarted.apply(Delivered(p, again, s, s, 0))
                restarted.apply(Delivered(p, [], 0, last, 0))
                folds[p] = restarted
            if rng.random() < 0.05:
                saved[p] = folds[p].encode()
        findings, folded = merge.add(_answers(folds, merge, now, kept))
        assert findings == expected, kept
        assert folded == len(stored)


def test_a_partition_not_owned_counts_as_empty() -> None:
    events = history(4, Shape(transfers=20))
    mine = [e for e in events if partition_of(e.transfer_id, PARTITIONS) == 1]
    fold = PartitionFold(1, PARTITIONS)
    fold.apply(Delivered(1, [((i + 1) << 16 | 1, e) for i, e in enumerate(mine)], len(mine), len(mine), 0))
    now = max(e.ts for e in mine) + 1.0
    findings, folded = LiveMerge(PARTITIONS, [1]).add([fold.answer(now)])
    assert findings == audit(replay_chunks([mine]).state, now)
    assert folded == len(mine)


def test_transfer_pages_list_every_matching_side_once_in_first_seen_order() -> None:
    events = history(5, Shape(transfers=60, consumers=("decode-0/tp0", "decode-1/tp0")))
    messages = _messages(events)
    folds = {p: PartitionFold(p, PARTITIONS, track_sides=True) for p in range(PARTITIONS)}
    for seq, p, rows in messages:
        folds[p].apply(Delivered(p, rows, seq, seq, 0))
    firsts: dict[tuple[str, str], int] = {}
    for _, _, rows in messages:
        for cursor, e in rows:
            firsts.setdefault((e.source, e.transfer_id), cursor)
    workers = [{0: folds[0], 2: folds[2]}, {1: folds[1]}, {3: folds[3]}]
    for source, limit, scan_max in [(None, 7, 5), ("decode-1/tp0", 3, 4), (None, 1000, 100_000)]:
        expected = sorted(
            (c, k) for k, c in firsts.items() if source is None or k[0] == source
            if any(k in f.folded.state.transfers for f in folds.values())
        )  # fmt: skip
        listed: list[tuple[str, str]] = []
        after: int | None = 0
        while after is not None:
            asked = SidesAsked(after, limit, None, source, None, None, None, None, scan_max)
            page, after = merge_pages([_sides(w, asked) for w in workers], limit)
            assert len(page) <= limit
            listed += [(t.source, t.transfer_id) for t in page]
        assert listed == [k for _, k in expected], (source, limit, scan_max)


def test_pictures_and_requests_of_partitions_merge_into_one_fold_s() -> None:
    """What the service's page and metrics read besides the findings (`Picture`), and `/requests/{id}`'s sides,
    told by partitions folded apart and merged, are one fold's: a request named for sides in several
    partitions lists them in the order maps first named them."""
    events = history(5, Shape(transfers=60, span_s=100.0, block_pool=8, reuse_rate=0.2, orphan_rate=0.1))
    t0 = max(e.ts for e in events)
    multi = Side("multi-0/tp0", start_ts=t0)
    events += [multi.map(f"tx-multi-{i}", "r-multi", blocks=(i,), deadline=t0 + 50) for i in range(8)]
    events.append(multi.map("tx-multi-0", "r-again", blocks=(99,)))  # refused (id reuse): named all the same
    messages = _messages(events)
    stored = [e for _, _, rows in messages for _, e in rows]
    assert len({partition_of(e.transfer_id, PARTITIONS) for e in stored if e.transfer_id.startswith("tx-multi")}) > 1
    folds = {p: PartitionFold(p, PARTITIONS, track_sides=True) for p in range(PARTITIONS)}
    for seq, p, rows in messages:
        folds[p].apply(Delivered(p, rows, seq, seq, 0))
    now = t0 + 10.0
    one = LedgerState()
    last_ts: dict[str, float] = {}
    by_kind = dict.fromkeys(KINDS, 0)
    by_request: dict[str, list[tuple[str, str]]] = {}
    first_map: tuple[int, float] | None = None
    end = float("-inf")
    for _, _, rows in messages:
        for cursor, e in rows:
            if one.apply(e) is not None or type(e) is Map:  # the blocks-held series' events
                end = max(end, e.ts)
            by_kind[KIND_OF_TYPE[type(e)]] += 1
            last_ts[e.source] = max(last_ts.get(e.source, 0.0), e.ts)
            if type(e) is Map:
                first_map = first_map or (cursor, e.ts)
                keys = by_request.setdefault(e.request_id, [])
                if (e.source, e.transfer_id) not in keys:
                    keys.append((e.source, e.transfer_id))
    findings = audit(one, now)
    expected = picture_of(
        one, findings, None, last_ts=last_ts, events_by_kind=by_kind, first_map=first_map, holding_end_ts=end
    )
    parts = [f.answer(now, since=0, picture=True) for f in folds.values()]
    merged = merge_pictures([a.picture for a in parts if a.picture is not None])
    # Each partition's findings' times, one partition's after another's: as one fold times them.
    assert merged.found_at == [found_at(f, one) for a in parts for f in a.findings]
    assert msgspec.structs.replace(merged, found_at=expected.found_at) == expected
    assert expected.late_after_expire and expected.held and expected.live_by_phase
    workers = [{p: folds[p] for p in group} for group in ([0, 2], [1], [3])]
    for request_id, keys in by_request.items():
        sides = merge_request_sides([_request_sides(w, request_id) for w in workers])
        assert sides is not None and [(t.source, t.transfer_id) for t in sides] == keys, request_id
    assert len(by_request["r-multi"]) == 8 and by_request["r-again"] == [("multi-0/tp0", "tx-multi-0")]
    assert merge_request_sides([_request_sides(w, "no-such-request") for w in workers]) is None


def test_a_drop_before_its_side_s_first_event_does_not_list_the_side_at_the_drop() -> None:
    """Partition 0 folds every `drop` (`partition_of_event`). A drop names a side but makes none: one delivery
    holding a drop and then the first event of the side it names lists the side at that event's cursor, as
    the one-process service lists it (`kvledger.ledger.projection`: a side is listed where the fold made it)."""
    tid = next(f"tx-{i}" for i in range(100) if partition_of(f"tx-{i}", PARTITIONS) == 0)
    side = Side("decode-0/tp0")
    rows: list[tuple[int, Event]] = [(1 << 16 | 1, side.drop(tid)), (1 << 16 | 2, side.map(tid, "r-1"))]
    fold = PartitionFold(0, PARTITIONS, track_sides=True)
    fold.apply(Delivered(0, rows, 1, 1, 0))
    assert [(first, t.transfer_id) for first, t in fold.sides_after(0)] == [(1 << 16 | 2, tid)]
