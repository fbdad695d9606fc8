"""The side readings other layers take from the fold (ledger/side.py): whether a side still awaits the data
it moves (`awaits_data`, what a worker re-issues after a transient failure) and the request index the sides'
maps give (`requests_of`, what a snapshot checks its own index against). Each rule driven through folded
sides, as a caller reads them."""

from __future__ import annotations

import msgspec
import pytest

from kvledger.ledger.decisions import Key
from kvledger.ledger.events import Event, TransferId
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.side import (
    TransferState,
    awaits_data,
    completed_by,
    local_exceeds_remote,
    requests_of,
    wide_masks,
)
from tests.ledger.builders import Side

T = TransferId("tx-1")
P, C = "prefill-0/tp0", "decode-0/tp0"


def _side(state: LedgerState, source: str, tid: str = T) -> TransferState:
    return state.transfers[(source, TransferId(tid))]


def test_a_read_consumer_awaits_data_until_its_whole_read_is_acked() -> None:
    c = Side(C)
    state, _ = fold_all([c.map(T, "r-1", "consumer", "read", remote=(7, 8, 9)), c.schedule(T)])
    assert awaits_data(_side(state, C))
    state.apply(c.fail(T, "SQ full", retryable=True))  # a transient failure: the read is still to do
    assert awaits_data(_side(state, C))
    release = state.apply(c.ack(T, "read"))
    assert release is not None and release.cause == "completed"
    assert not awaits_data(_side(state, C))


def test_a_write_producer_awaits_data_while_a_sealed_layer_is_unwritten() -> None:
    p = Side(P)
    events: list[Event] = [p.map(T, "w-1", "producer", "write"), p.schedule(T, (0, 1), op="write"), p.seal(T, 2)]
    state, _ = fold_all(events)
    assert awaits_data(_side(state, P))  # sealed at two layers, none written
    state.apply(p.ack(T, "write", (0,)))
    state.apply(p.fail(T, "RDMA write timed out", retryable=True))
    assert awaits_data(_side(state, P))  # one of two written: layer 1 is re-issued
    release = state.apply(p.ack(T, "write", (1,)))
    assert release is not None and release.cause == "completed"
    assert not awaits_data(_side(state, P))  # every sealed layer written: nothing left to move


def test_a_write_producer_before_its_seal_awaits_no_data() -> None:
    p = Side(P)
    state, _ = fold_all([p.map(T, "w-1", "producer", "write"), p.schedule(T, (0, 1), op="write")])
    assert _side(state, P).expected is None
    assert not awaits_data(_side(state, P))  # how many layers is not known yet: nothing to re-issue


def test_sides_that_move_no_data_themselves_never_await_it() -> None:
    p, c = Side(P), Side(C)
    events: list[Event] = [
        p.map(T, "r-1", "producer", "read"),  # a READ producer: its consumer reads
        c.map("tx-2", "w-1", "consumer", "write", remote=(1, 2, 3)),  # a WRITE consumer: its producer writes
        c.schedule("tx-2"),
    ]
    state, releases = fold_all(events)
    assert releases == []
    assert not awaits_data(_side(state, P))
    assert not awaits_data(_side(state, C, "tx-2"))
    state.apply(p.seal(T, 2))  # a seal names layers, but none of them are this side's to move
    state.apply(c.seal("tx-2", 2))
    assert _side(state, P).expected == _side(state, C, "tx-2").expected == 2
    assert not awaits_data(_side(state, P))
    assert not awaits_data(_side(state, C, "tx-2"))


def test_requests_of_gathers_each_requests_sides_in_the_sides_order() -> None:
    p, c = Side(P), Side(C)
    events: list[Event] = [
        p.map("tx-a", "req-1", "producer", "read"),
        c.ack("tx-orphan", "recv"),  # never mapped: in no request
        p.map("tx-b", "req-2", "producer", "read", blocks=(4,)),
        c.map("tx-a", "req-1", "consumer", "read", blocks=(5, 6, 7), remote=(1, 2, 3)),
    ]
    state, _ = fold_all(events)
    keys = list(state.transfers)
    sides = list(state.transfers.values())
    assert requests_of(keys, sides) == {
        "req-1": ((P, "tx-a"), (C, "tx-a")),
        "req-2": ((P, "tx-b"),),
    }
    backwards = requests_of(keys[::-1], sides[::-1])
    assert backwards["req-1"] == ((C, "tx-a"), (P, "tx-a"))


def test_requests_of_keeps_the_callers_own_keys() -> None:
    p = Side(P)
    state, _ = fold_all([p.map("tx-a", "req-1"), p.map("tx-b", "req-1", blocks=(4,))])
    keys: list[Key] = [(P, TransferId("tx-a")), (P, TransferId("tx-b"))]  # equal to the fold's, not the same objects
    index = requests_of(keys, list(state.transfers.values()))
    assert [id(key) for key in index["req-1"]] == [id(key) for key in keys]


def test_requests_of_refuses_keys_that_do_not_pair_with_the_sides() -> None:
    p = Side(P)
    state, _ = fold_all([p.map("tx-a", "req-1"), p.map("tx-b", "req-2", blocks=(4,))])
    sides = list(state.transfers.values())
    with pytest.raises(ValueError, match="1 keys for 2 sides"):
        requests_of([(P, TransferId("tx-a"))], sides)
    assert requests_of([], []) == {}


def _completed_by_after(events: list[Event]) -> str | None:
    state, _ = fold_all(events)
    (side,) = state.transfers.values()
    return completed_by(side)


def test_completed_by_names_the_evidence_that_completed_each_kind_of_side() -> None:
    p, c = Side(P), Side(C)
    write: list[Event] = [p.map(T, "w-1", "producer", "write"), p.schedule(T, (0, 1), op="write"), p.seal(T, 2)]
    assert _completed_by_after(write) is None
    assert _completed_by_after([*write, p.ack(T, "write", (0, 1))]) == "all_written"
    assert _completed_by_after([*write, p.ack(T, "release")]) == "release_acks"  # the consumer let it go
    fan_in: list[Event] = [p.map("tx-2", "r-2", "producer", "read", acks=2), p.ack("tx-2", "release", rank=0)]
    assert _completed_by_after(fan_in) is None
    assert _completed_by_after([*fan_in, p.ack("tx-2", "release", rank=1)]) == "release_acks"
    read: list[Event] = [c.map("tx-3", "r-3", "consumer", "read", remote=(7, 8, 9)), c.schedule("tx-3")]
    assert _completed_by_after([*read, c.ack("tx-3", "read")]) == "whole_read"
    assert _completed_by_after([*read, c.ack("tx-3", "recv")]) == "recv"
    layered: list[Event] = [c.map("tx-4", "r-4", "consumer", "read", remote=(7, 8, 9)), c.schedule("tx-4", (0, 1))]
    assert _completed_by_after([*layered, c.ack("tx-4", "read", (0, 1)), c.seal("tx-4", 2)]) == "all_read"
    written: list[Event] = [c.map("tx-5", "w-5", "consumer", "write", remote=(7, 8, 9)), c.ack("tx-5", "write", (0, 1))]
    assert _completed_by_after(written) is None  # a WRITE consumer completes on recv alone
    assert _completed_by_after([*written, c.ack("tx-5", "recv")]) == "recv"


@pytest.mark.parametrize(
    ("blocks", "local_groups", "remote_groups", "refused"),
    [
        (3, (2, 1), None, False),  # groups on one side only: the totals are compared
        (4, (2, 2), None, True),
        (3, None, (1, 2), False),
        (4, None, (2, 1), True),
    ],
)
def test_a_consumer_with_groups_on_one_side_only_is_checked_by_its_total(
    blocks: int, local_groups: tuple[int, ...] | None, remote_groups: tuple[int, ...] | None, refused: bool
) -> None:
    c = Side(C)
    mapped = msgspec.structs.replace(
        c.map(T, "r-1", "consumer", "read", blocks=tuple(range(1, blocks + 1)), remote=(7, 8, 9)),
        block_groups=local_groups,
        remote_block_groups=remote_groups,
    )
    assert local_exceeds_remote(mapped) is refused
    _, releases = fold_all([mapped])
    assert [r.why for r in releases] == (["local_exceeds_remote"] if refused else [])


def test_wide_masks_finds_a_side_wide_in_any_one_of_its_masks() -> None:
    p, c = Side(P), Side(C)
    events: list[Event] = [
        p.map("tx-narrow", "r-0", "producer", "write", blocks=(1,)),
        p.schedule("tx-narrow", (0, 62), op="write"),
        p.map("tx-scheduled", "r-1", "producer", "write", blocks=(2,)),
        p.schedule("tx-scheduled", (63,), op="write"),
        p.map("tx-acked", "r-2", "producer", "write", blocks=(3,)),
        p.schedule("tx-acked", (70,), op="write"),
        p.ack("tx-acked", "write", (70,)),
        c.ack("tx-early", "read", (70,)),  # before its schedule (and its map): an early ack
        p.map("tx-ranks", "r-4", "producer", "read", blocks=(4,), acks=2),
        p.ack("tx-ranks", "release", rank=100),
    ]
    state, _ = fold_all(events)
    sides = list(state.transfers.values())
    names = [t.transfer_id for t in sides]
    assert names == ["tx-narrow", "tx-scheduled", "tx-acked", "tx-early", "tx-ranks"]
    assert [names[i] for i in wide_masks(sides, 63)] == names[1:]
    assert wide_masks(sides, 128) == []
