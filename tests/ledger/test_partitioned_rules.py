"""The partitioned fold's rules at its edges (kvledger.ledger.partitioned), through its public parts: `slices`
numbers each event by its place in the whole stream and cuts as a replay cuts, `fold_partition` and `answer`
fold and audit as one fold does with the caller's settings (a cut, a config, no compaction, releases not
kept), and `Merger` refuses answers that are not one log's partitions each once, and takes the first event's
time from the stream's first event."""

from __future__ import annotations

import pytest

from kvledger.ledger.audit import AuditConfig, audit
from kvledger.ledger.events import Event
from kvledger.ledger.merge import batched
from kvledger.ledger.partition import partition_of_event
from kvledger.ledger.partitioned import (
    Batch,
    Merged,
    Merger,
    PartitionAnswer,
    answer,
    fold_partition,
    merge,
    slices,
)
from kvledger.ledger.replay import ReplayResult, replay_chunks
from kvledger.ledger.summary import state_counts
from tests.ledger.builders import Side
from tests.ledger.histories import Shape, history

P, C = "prefill-0/tp0", "decode-0/tp0"
Chunks = list[list[Event]]


def _events(seed: int = 5) -> list[Event]:
    return history(seed, Shape(transfers=30, span_s=60.0, faults_per_side=2.0, block_pool=5))


def _merged(
    chunks: Chunks,
    jobs: int,
    now: float,
    config: AuditConfig | None = None,
    *,
    until_seq: int | None = None,
    until_ts: float | None = None,
    compact_every: int | None = 64,
    keep_releases: bool = True,
) -> tuple[Merged, bool]:
    """Each partition sliced, folded and answered alone, then merged; and whether a slicing was cut short."""
    stopped: list[bool] = []
    answers = []
    for p in range(jobs):
        parts = slices(chunks, p, jobs, until_seq=until_seq, until_ts=until_ts, stopped=stopped)
        folded = fold_partition(parts, p, jobs, compact_every=compact_every, keep_releases=keep_releases)
        answers.append(answer(folded, now, config))
    return merge(answers), bool(stopped)


def _one_fold(chunks: Chunks, *, until_seq: int | None = None, until_ts: float | None = None) -> ReplayResult:
    return replay_chunks(chunks, compact_every=64, until_seq=until_seq, until_ts=until_ts)


def test_slices_number_each_event_by_its_place_in_the_whole_stream() -> None:
    p, c = Side(P, start_ts=10.0), Side(C, start_ts=10.0)
    first: list[Event] = [p.map("tx-1", "r-1"), c.ack("tx-2", "recv"), p.map("tx-3", "r-3", blocks=(4,))]
    second: list[Event] = [c.ack("tx-2", "recv", ts=9.0), p.ack("tx-1", "release")]  # a clock stepped back
    chunks = [first, [], second]
    assert list(slices(chunks, 0, 1)) == [
        (first, [1, 2, 3], 3, max(e.ts for e in first)),
        (second, [4, 5], 2, max(e.ts for e in second)),
    ]
    for partitions in (2, 3):
        numbered: dict[int, Event] = {}
        for partition in range(partitions):
            mine = list(slices(chunks, partition, partitions))
            assert len(mine) == 2  # one slice per chunk that holds events, whichever partition they are of
            for (events, indices, stream_events, newest), whole in zip(mine, (first, second), strict=True):
                assert all(partition_of_event(e, partitions) == partition for e in events)
                numbered.update(zip(indices, events, strict=True))
                assert stream_events == len(whole) and newest == max(e.ts for e in whole)  # the whole chunk's
        assert [numbered[i] for i in sorted(numbered)] == [*first, *second]


def test_slices_refuse_a_partition_out_of_range() -> None:
    events = _events()
    for partition, partitions in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=f"partition {partition} is not in range\\({partitions}\\)"):
            list(slices([events], partition, partitions))
        with pytest.raises(ValueError, match=f"partition {partition} is not in range\\({partitions}\\)"):
            fold_partition([], partition, partitions)
    assert list(slices([events], 1, 2)) and fold_partition([], 1, 2).events == 0


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_partitioned_fold_cut_by_seq_or_ts_is_one_folds_cut_and_says_it_stopped(jobs: int) -> None:
    events = _events()
    chunks = list(batched(events, 16))
    middle = events[len(events) // 2]
    for until_seq, until_ts in ((None, middle.ts), (middle.seq, None), (None, events[-1].ts + 1.0)):
        one = _one_fold(chunks, until_seq=until_seq, until_ts=until_ts)
        merged, stopped = _merged(chunks, jobs, middle.ts, until_seq=until_seq, until_ts=until_ts)
        assert merged.releases == one.releases and merged.events == one.events
        assert merged.findings == audit(one.state, middle.ts)
        assert merged.first_ts == one.first_ts and merged.last_ts == one.last_ts
        assert stopped is one.stopped_early
    assert _one_fold(chunks, until_ts=middle.ts).stopped_early  # the cuts above left something out


def test_a_partitions_answer_audits_with_the_callers_config() -> None:
    events = _events()
    chunks = list(batched(events, 16))
    now = events[-1].ts + 40.0
    config = AuditConfig(transfer_timeout_s=2.0, clock_skew_s=0.0)
    one = _one_fold(chunks)
    expected = audit(one.state, now, config)
    assert expected != audit(one.state, now), "the config changes the findings"
    for jobs in (1, 2):
        assert _merged(chunks, jobs, now, config)[0].findings == expected


def test_a_partitioned_fold_without_compaction_or_releases_kept_is_one_such_fold() -> None:
    events = _events()
    chunks = list(batched(events, 16))
    now = events[-1].ts
    whole = replay_chunks(chunks, compact_every=None, keep_releases=False)
    assert whole.releases == [] and whole.release_count
    for jobs in (1, 3):
        merged, _ = _merged(chunks, jobs, now, compact_every=None, keep_releases=False)
        assert merged.releases == []
        assert merged.counts == state_counts(whole.state)
        assert merged.findings == audit(whole.state, now)
    compacted = _one_fold(chunks)
    assert state_counts(compacted.state) != state_counts(whole.state), "compaction shows in the counts"


def test_the_merge_takes_the_first_events_time_from_the_streams_first_event() -> None:
    p, c = Side(P), Side(C)
    events: list[Event] = [
        p.map("tx-1", "r-1", ts=50.0),
        c.ack("tx-2", "recv", ts=20.0),
        p.ack("tx-1", "release", ts=60.0),
    ]
    one = _one_fold([events])
    assert one.first_ts == 50.0 and one.last_ts == 60.0  # the first event's time, not the earliest
    for jobs in (1, 2, 3, 4):
        merged, _ = _merged([events], jobs, 60.0)
        assert (merged.first_ts, merged.last_ts, merged.events) == (50.0, 60.0, 3), jobs


def test_the_merge_of_an_empty_stream_has_no_times() -> None:
    for jobs in (1, 3):
        merged, stopped = _merged([], jobs, 0.0)
        assert (merged.first_ts, merged.last_ts, merged.events, merged.releases, merged.findings) == (
            None, None, 0, [], [],
        )  # fmt: skip
        assert not stopped


def _answers(events: list[Event], jobs: int) -> list[PartitionAnswer]:
    return [answer(fold_partition(slices([events], p, jobs), p, jobs), events[-1].ts) for p in range(jobs)]


def test_the_merge_refuses_answers_that_are_not_each_partition_once() -> None:
    events = _events()
    two, three = _answers(events, 2), _answers(events, 3)
    with pytest.raises(ValueError, match=r"partition answers \[0, 0\] are not each of range\(2\) once"):
        Merger(2).finish([two[0], two[0]])
    with pytest.raises(ValueError, match=r"partition answers \[0\] are not each of range\(2\) once"):
        Merger(2).finish([two[0]])
    with pytest.raises(ValueError, match=r"are not each of range\(2\) once"):
        Merger(2).finish([two[0], three[1]])  # one of another partitioning
    with pytest.raises(ValueError, match="no partition answers to merge"):
        merge([])
    with pytest.raises(ValueError, match="partitions must be at least 1, got 0"):
        Merger(0)
    assert merge(reversed(two)).findings == merge(two).findings == audit(_one_fold([events]).state, events[-1].ts)


def test_the_merge_refuses_partitions_that_read_streams_of_different_lengths() -> None:
    events = _events()
    short = events[: len(events) // 2]
    answers = [_answers(events, 2)[0], _answers(short, 2)[1]]
    with pytest.raises(
        ValueError, match=rf"partitions read streams of different lengths: \[{len(events)}, {len(short)}\]"
    ):
        Merger(2).finish(answers)


def test_the_merge_refuses_a_partition_whose_batches_go_back() -> None:
    merger = Merger(2)
    merger.add(0, Batch(5, [], [], [], []))
    with pytest.raises(ValueError, match="partition 0 went back from 5 to 4"):
        merger.add(0, Batch(4, [], [], [], []))
    merger.add(0, Batch(5, [], [], [], []))  # the same position again: nothing new, not back
