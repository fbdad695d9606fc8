"""One scenario per behaviour the connectors got wrong in the field, driven through the fold."""

from __future__ import annotations

import msgspec
import pytest

from kvledger.ledger.audit import audit, counts_by_code
from kvledger.ledger.decisions import VllmOutcome
from kvledger.ledger.events import block_groups_of, from_json, from_msgpack, to_json, to_msgpack
from kvledger.ledger.fold import REASON_LOCAL_EXCEEDS_REMOTE, LedgerState, fold_all
from kvledger.ledger.lifecycle import TRANSITIONS, Phase
from kvledger.ledger.valid import event_problem
from tests.ledger.builders import Side

T = "tx-1"


def test_ack_before_map_is_kept_and_counted_at_map_time() -> None:
    c = Side("decode-0/tp0")
    state = LedgerState()
    assert state.apply(c.ack(T, "recv")) is None
    t = state.transfers[("decode-0/tp0", T)]
    assert t.phase == Phase.UNMAPPED and t.recv
    release = state.apply(c.map(T, "c-1", "consumer", "write", blocks=(5, 6), remote=(1, 2)))
    assert release is not None
    assert release.cause == "completed" and release.block_ids == (5, 6) and release.request_id == "c-1"
    assert state.blocks_held == 0


def test_release_acks_before_map_complete_the_fan_in_at_map() -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    assert state.apply(p.ack(T, "release", rank=0)) is None
    assert state.apply(p.ack(T, "release", rank=1)) is None
    release = state.apply(p.map(T, "p-1", "producer", "read", acks=2))
    assert release is not None and release.cause == "completed"


def test_send_queue_full_retry_then_success() -> None:
    c = Side("decode-0/tp0")
    events = [
        c.map(T, "c-1", "consumer", "read", blocks=(1, 2), remote=(7, 8)),
        c.schedule(T),
        c.fail(T, "SQ full", retryable=True),
        c.schedule(T, attempt=1),
        c.ack(T, "read"),
    ]
    state, releases = fold_all(events)
    assert [r.cause for r in releases] == ["completed"]
    assert releases[0].seq == 5  # not at the transient failure
    t = state.transfers[("decode-0/tp0", T)]
    assert t.transient_failures == 1 and t.retries == 1 and not t.has_anomaly
    told = VllmOutcome.of(releases)
    assert told.finished_recving == {"c-1"} and not told.failed_recving and not told.invalid_block_ids


def test_retry_past_the_transfer_timeout_then_terminal_fail_releases() -> None:
    c = Side("decode-0/tp0")
    events = [c.map(T, "c-1", "consumer", "read", blocks=(1, 2), remote=(7, 8)), c.schedule(T)]
    for attempt in range(1, 6):
        events += [c.fail(T, "SQ full", retryable=True), c.schedule(T, attempt=attempt)]
    events.append(c.fail(T, "SQ full past transfer_timeout"))
    state, releases = fold_all(events)
    assert len(releases) == 1 and releases[0].cause == "failed"
    assert releases[0].reason == "SQ full past transfer_timeout"
    assert releases[0].seq == events[-1].seq
    told = VllmOutcome.of(releases)
    assert told.failed_recving == {"c-1"} and told.finished_recving == {"c-1"} and not told.finished_sending
    assert told.invalid_block_ids == {1, 2}
    t = state.transfers[("decode-0/tp0", T)]
    assert t.transient_failures == 5 and t.retries == 5 and t.deferrals == 0


def test_failed_write_releases_the_producer() -> None:
    p = Side("prefill-0/tp0")
    events = [
        p.map(T, "p-1", "producer", "write"),
        p.schedule(T, (0, 1), op="write"),
        p.fail(T, "RDMA write failed"),
    ]
    _, releases = fold_all(events)
    assert [(r.cause, r.role) for r in releases] == [("failed", "producer")]
    told = VllmOutcome.of(releases)
    assert told.finished_sending == {"p-1"} and not told.finished_recving and not told.failed_recving
    assert told.invalid_block_ids == set()  # a producer's blocks are not load errors


def test_deferred_write_expires_and_releases() -> None:
    p = Side("prefill-0/tp0")
    events = [
        p.map(T, "p-1", "producer", "write", deadline=1000.5),
        p.schedule(T, (0,), op="write", deferred=True),
        p.expire(T, "defer", ts=1000.6),
    ]
    state, releases = fold_all(events)
    assert [r.cause for r in releases] == ["expired"]
    assert state.transfers[("prefill-0/tp0", T)].deferrals == 1
    assert state.blocks_held == 0


def test_deferred_and_retried_schedules_are_counted_when_their_layers_are_known() -> None:
    """The inline schedule path (a layer tuple seen before) takes first tries only: a deferral or a
    retry of fresh layers is counted, and is never a duplicate."""
    p = Side("prefill-0/tp0")
    state, _ = fold_all(
        [
            p.map("warm", "p-0", "producer", "write", blocks=(9,)),
            p.schedule("warm", (0,), op="write"),  # the tuple (0,) is known from here on
            p.map("deferred", "p-1", "producer", "write", blocks=(1,)),
            p.schedule("deferred", (0,), op="write", deferred=True),
            p.map("retried", "p-2", "producer", "write", blocks=(2,)),
            p.schedule("retried", (0,), op="write", attempt=1),
            p.schedule("retried", (0,), op="write", attempt=2),
        ]
    )
    deferred, retried = state.transfers[(p.source, "deferred")], state.transfers[(p.source, "retried")]
    assert (deferred.deferrals, deferred.retries, deferred.scheduled, deferred.phase) == (1, 0, {0}, "active")
    assert (retried.deferrals, retried.retries, retried.scheduled) == (0, 2, {0})
    assert not deferred.has_anomaly and not retried.has_anomaly


def test_write_mode_layer_dedupe_seal_and_completion() -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    decisions = [
        state.apply(p.map(T, "p-1", "producer", "write")),
        state.apply(p.schedule(T, (0, 1), op="write")),
        state.apply(p.schedule(T, (1,), op="write")),  # second schedule of layer 1: no-op
        state.apply(p.ack(T, "write", (0, 1))),
        state.apply(p.schedule(T, (2, 3), op="write")),
        state.apply(p.ack(T, "write", (2,))),
        state.apply(p.ack(T, "write", (2,))),  # duplicate ack: no-op
    ]
    assert decisions == [None] * 7
    t = state.transfers[("prefill-0/tp0", T)]
    assert t.scheduled == {0, 1, 2, 3} and t.acked == {0, 1, 2}
    assert state.apply(p.seal(T, 4)) is None  # sealed, one layer still in flight
    assert t.phase == Phase.SEALED
    release = state.apply(p.ack(T, "write", (3,)))
    assert release is not None and release.cause == "completed"
    codes = counts_by_code(audit(state, now=p.ts))
    assert codes["duplicate"] == 1 and codes["over_ack"] == 0 and codes["leak"] == 0


def test_write_acks_are_over_ack_evidence_on_a_read_producer_and_never_complete_it() -> None:
    """A READ producer is freed by release acks only. Write acks of layers it happens to have scheduled
    once took the WRITE producer's inline paths: counted silently, and with a seal they completed it."""
    p = Side("prefill-0/tp0")
    state = LedgerState()
    events = [
        p.map(T, "p-1", "producer", "read"),
        p.schedule(T, (0,), op="write"),  # caches the layer tuple: the inline ack path is warm
        p.ack(T, "write", (0,)),
        p.schedule(T, (1,), op="write"),
        p.seal(T, 2),
        p.ack(T, "write", (1,)),
    ]
    assert [state.apply(e) for e in events] == [None] * len(events)
    t = state.transfers[(p.source, T)]
    assert t.live and t.over_ack_seqs == [3, 6]
    release = state.apply(p.ack(T, "release"))
    assert release is not None and release.cause == "completed"


def test_a_write_mode_consumer_completes_on_recv_only() -> None:
    """Layer writes landing on a WRITE consumer (scheduled and sealed, even) are not all its KV: only
    `recv` says the transfer arrived."""
    c = Side("decode-0/tp0")
    state = LedgerState()
    events = [
        c.map(T, "c-1", "consumer", "write", remote=(1, 2, 3)),
        c.schedule(T, (0,), op="write", deferred=True),
        c.seal(T, 1),
        c.ack(T, "write", (0,)),
    ]
    assert [state.apply(e) for e in events] == [None] * len(events)
    t = state.transfers[(c.source, T)]
    assert t.live and t.acked == {0} and not t.has_anomaly
    release = state.apply(c.ack(T, "recv"))
    assert release is not None and release.cause == "completed"


def test_all_writes_acked_before_seal_completes_at_seal() -> None:
    p = Side("prefill-0/tp0")
    events = [
        p.map(T, "p-1", "producer", "write"),
        p.schedule(T, (0, 1), op="write"),
        p.ack(T, "write", (0, 1)),
        p.seal(T, 2),
    ]
    _, releases = fold_all(events)
    assert [(r.cause, r.seq) for r in releases] == [("completed", 4)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_read_mode_release_fan_in(ranks: int) -> None:
    p = Side("prefill-0/tp0")
    state = LedgerState()
    assert state.apply(p.map(T, "p-1", "producer", "read", acks=ranks)) is None
    for rank in range(ranks - 1):
        assert state.apply(p.ack(T, "release", rank=rank)) is None
        assert state.apply(p.ack(T, "release", rank=rank)) is None  # same rank twice counts once
    release = state.apply(p.ack(T, "release", rank=ranks - 1))
    assert release is not None and release.cause == "completed"
    assert state.transfers[("prefill-0/tp0", T)].release_ranks == set(range(ranks))


def test_consumer_local_blocks_longer_than_remote_is_rejected() -> None:
    c = Side("decode-0/tp0")
    _, releases = fold_all([c.map(T, "c-1", "consumer", "read", blocks=(1, 2, 3), remote=(7, 8))])
    assert len(releases) == 1
    assert releases[0].cause == "failed" and releases[0].reason == REASON_LOCAL_EXCEEDS_REMOTE
    assert VllmOutcome.of(releases).invalid_block_ids == {1, 2, 3}


@pytest.mark.parametrize(
    ("local_groups", "remote_groups", "refused"),
    [
        ((2, 1), (2, 1), False),  # every group pairs one to one
        ((1, 1), (2, 1), False),  # a shorter group takes the remote tail (a local prefix hit)
        ((1, 2), (2, 1), True),  # as many blocks in all, but the second group has more than its producer's
        ((3,), (2, 1), True),  # another number of groups: no pairing exists
    ],
)
def test_consumer_blocks_are_checked_against_the_remote_group_by_group(
    local_groups: tuple[int, ...], remote_groups: tuple[int, ...], refused: bool
) -> None:
    """vLLM's hybrid models: a consumer may not hold more blocks than its producer filled in any KV cache group."""
    c = Side("decode-0/tp0")
    mapped = msgspec.structs.replace(
        c.map(T, "c-1", "consumer", "read", blocks=tuple(range(1, sum(local_groups) + 1)), remote=(7, 8, 9)),
        block_groups=local_groups,
        remote_block_groups=remote_groups,
    )
    state, releases = fold_all([mapped])
    if refused:
        assert [r.reason for r in releases] == [REASON_LOCAL_EXCEEDS_REMOTE]
    else:
        assert not releases and state.blocks_held == sum(local_groups)


def test_map_block_groups_must_add_up_to_the_blocks() -> None:
    c = Side("decode-0/tp0")
    mapped = c.map(T, "c-1", "consumer", "read", blocks=(1, 2, 3), remote=(7, 8, 9))
    with pytest.raises(ValueError, match="block_groups"):
        msgspec.structs.replace(mapped, block_groups=(1, 1))
    assert block_groups_of((1, 2, 3, 4), (1, 0, 3)) == ((1,), (), (2, 3, 4))
    assert block_groups_of((1, 2), None) == ((1, 2),)
    grouped = msgspec.structs.replace(mapped, block_groups=(2, 1), remote_block_groups=(1, 2), seq=1)
    # Stored and exported as any other field (both encodings), and an old log without it reads as one group.
    assert from_json(to_json(grouped)) == grouped and from_msgpack(to_msgpack(grouped)) == grouped
    assert event_problem(grouped) is None
    assert from_json(to_json(msgspec.structs.replace(grouped, block_groups=None))).block_groups is None


def test_consumer_local_blocks_shorter_than_remote_is_accepted() -> None:
    c = Side("decode-0/tp0")
    events = [c.map(T, "c-1", "consumer", "read", blocks=(1,), remote=(7, 8)), c.schedule(T), c.ack(T, "read")]
    _, releases = fold_all(events)
    assert [r.cause for r in releases] == ["completed"]


def test_late_ack_after_expire_is_a_finding_that_says_the_timeout_is_short() -> None:
    p = Side("prefill-0/tp0")
    events = [
        p.map(T, "p-1", "producer", "read", acks=1, deadline=1001.0),
        p.expire(T, ts=1001.5),
        p.ack(T, "release", ts=1002.0),
    ]
    state, releases = fold_all(events)
    assert [r.cause for r in releases] == ["expired"]
    findings = audit(state, now=1003.0)
    assert [f.code for f in findings] == ["late_event"]
    assert findings[0].evidence == (3,) and "timeout is too short" in findings[0].detail


def test_terminal_fail_before_map_fails_at_map() -> None:
    c = Side("decode-0/tp0")
    events = [c.fail(T, "write_failed from producer"), c.map(T, "c-1", "consumer", "write", remote=(1, 2, 3))]
    _, releases = fold_all(events)
    assert [(r.cause, r.reason, r.seq) for r in releases] == [("failed", "write_failed from producer", 2)]


def test_consumer_abort_release_frees_a_write_mode_producer_at_once() -> None:
    p = Side("prefill-0/tp0")
    events = [p.map(T, "p-1", "producer", "write"), p.ack(T, "release")]
    _, releases = fold_all(events)
    assert [r.cause for r in releases] == ["completed"]


def test_leak_stuck_and_orphan_audits_follow_now() -> None:
    p = Side("prefill-0/tp0")
    state, _ = fold_all(
        [
            p.map("tx-a", "p-a", deadline=1010.0, ts=1000.0),
            p.map("tx-b", "p-b", blocks=(4, 5), deadline=1100.0, ts=1000.0),
            p.ack("tx-orphan", "release", ts=1000.0),
        ]
    )
    assert audit(state, now=1005.0) == []
    findings = audit(state, now=1040.0)
    assert sorted(f.code for f in findings) == ["leak", "orphan_ack", "stuck"]
    leak = next(f for f in findings if f.code == "leak")
    assert leak.transfer_id == "tx-a" and leak.block_ids == (1, 2, 3) and leak.evidence == (1,)
    assert next(f for f in findings if f.code == "stuck").transfer_id == "tx-b"
    assert [t.transfer_id for t in state.due(1010.0)] == ["tx-a"]
    assert state.due(1009.99) == []


def test_orphan_expired_is_reported_and_a_second_expire_is_not_late() -> None:
    p = Side("prefill-0/tp0")
    state, releases = fold_all([p.ack(T, "release"), p.expire(T, "transfer"), p.expire(T, "transfer")])
    assert releases == []
    assert [f.code for f in audit(state, now=p.ts)] == ["orphan_ack"]


def test_double_owner_and_id_reuse() -> None:
    p = Side("prefill-0/tp0")
    state, _ = fold_all(
        [
            p.map("tx-a", "p-a", blocks=(1, 2)),
            p.map("tx-b", "p-b", blocks=(2, 3)),
            p.map("tx-a", "p-other", blocks=(9,)),
        ]
    )
    codes = counts_by_code(audit(state, now=p.ts))
    assert codes["double_owner"] == 1 and codes["id_reuse"] == 1
    assert state.claimants("prefill-0/tp0", 2) == [("prefill-0/tp0", "tx-a"), ("prefill-0/tp0", "tx-b")]
    assert state.claimants("prefill-0/tp0", 3) == [("prefill-0/tp0", "tx-b")]
    # When tx-a lets go of block 2, tx-b, still live, becomes its owner.
    state.apply(p.fail("tx-a", "abort"))
    assert state.claimants("prefill-0/tp0", 2) == [("prefill-0/tp0", "tx-b")]
    assert state.claimants("prefill-0/tp0", 1) == [] and state.blocks_held == 2
    assert counts_by_code(audit(state, now=p.ts))["double_owner"] == 0


def test_over_ack_for_unscheduled_layers_and_beyond_the_seal() -> None:
    p = Side("prefill-0/tp0")
    state, releases = fold_all(
        [
            p.map(T, "p-1", "producer", "write"),
            p.schedule(T, (0,), op="write"),
            p.ack(T, "write", (0, 5)),
            p.seal(T, 1),
        ]
    )
    assert [r.cause for r in releases] == ["completed"]
    assert [f.code for f in audit(state, now=p.ts)] == ["over_ack"]


def test_premature_release_over_a_merged_log() -> None:
    p, c = Side("prefill-0/tp0"), Side("decode-0/tp0")
    events = [
        p.map(T, "p-1", "producer", "read", deadline=1001.0, ts=1000.0),
        c.map(T, "c-1", "consumer", "read", remote=(1, 2, 3), ts=1000.1),
        c.schedule(T, ts=1000.2),
        p.expire(T, ts=1001.0),
        c.ack(T, "read", ts=1003.0),
    ]
    state, releases = fold_all(events)
    assert [(r.role, r.cause) for r in releases] == [("producer", "expired"), ("consumer", "completed")]
    findings = [f for f in audit(state, now=1004.0) if f.code == "premature_release"]
    assert len(findings) == 1 and findings[0].evidence == (2, 3)
    # Within the clock-skew allowance, it is not reported.
    from kvledger.ledger.audit import AuditConfig

    assert not [f for f in audit(state, 1004.0, AuditConfig(clock_skew_s=5.0)) if f.code == "premature_release"]


def test_compaction_forgets_decided_sides_but_a_late_event_is_judged_as_before() -> None:
    p = Side("prefill-0/tp0")
    events = [p.map(T, "p-1", acks=1), p.ack(T, "release"), p.map("tx-live", "p-2", blocks=(9,))]
    late = p.ack(T, "release", rank=1)
    whole, _ = fold_all([*events, late])
    state, _ = fold_all(events)
    assert state.compact({"prefill-0/tp0": 3}) == 1
    assert (p.source, T) not in state.transfers and ("prefill-0/tp0", "tx-live") in state.transfers
    assert state.apply(late) is None
    # The late ack recalls the compacted side: the same late_event finding as if it had never gone.
    t = state.transfers[(p.source, T)]
    assert t.closed and t.decision is not None and t.late_seqs == [late.seq]
    assert not state.unmapped and state.tombstone_count == 0
    assert audit(state, now=p.ts) == audit(whole, now=p.ts)
    assert [f.code for f in audit(state, now=p.ts)] == ["late_event"]


def test_the_transition_table_covers_every_live_phase_and_kind() -> None:
    live = [p for p in Phase.ALL if p not in (Phase.COMPLETED, Phase.FAILED, Phase.EXPIRED)]
    for phase in live:
        for kind in ("map", "schedule", "seal", "ack", "fail", "expire"):
            assert (phase, kind) in TRANSITIONS, (phase, kind)
