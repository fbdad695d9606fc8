"""A log folded in partitions, and the merge of the partitions' answers into the one-fold answer.

The unit of scale is a partition of the log by transfer (`kvledger.ledger.partition.partition_of`): both sides
of a transfer carry its id, so every per-transfer rule, and the cross-side premature-release audit,
stay inside one partition. Each partition is folded on its own (`fold_partition`: replay's `--jobs`)
into `Batch`es as it goes and a `PartitionAnswer` at the end; `Merger` (or `merge`, given the answers
alone) turns them into exactly what one fold of the whole log (`kvledger.ledger.replay.replay_chunks`) gives, in
the same order:

- releases in fold order: each carries its event's `index`, the position of the event that caused
  it in the whole stream (sorted by it);
- findings in the audit's total order (`kvledger.ledger.audit.finding_order`), plus the one cross-transfer
  rule, `double_owner` (a block held by two live sides of one source), judged here on a per-source
  block-ownership projection (`Ownership`) fed, in index order, by each partition's accepted maps
  (`Claim`) and releases; the partitions' own `double_owner` findings are left out (a partition sees
  only its own claimants);
- the summary's counts added up; the latency histograms added up (counts and maxima), the expired
  releases' block-seconds summed again in fold order (a float sum depends on its order).

Compaction follows the whole stream, not the partition: a partition compacts after the same chunks
of the stream as one fold does (by the count of the stream's events) with the
same cut (the stream's newest ts, `Slice`), so its state is one fold's state restricted to its
transfers, and the compaction counts add up to one fold's whatever the number of partitions.

`drop` events (forged control messages) name no transfer side: `kvledger.ledger.partition.partition_of_event`
sends them all to partition 0, so its latest-drops evidence is the whole log's.

Sans-IO: what reads the log and moves the answers (processes) lives above (cli/jobs.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter, itemgetter
from typing import Any, TypeAlias

import msgspec

from kvledger.ledger.advice import LatencyHistogram, LatencyRecorder, RecorderPlain
from kvledger.ledger.audit import AuditConfig, Finding, audit, finding_order
from kvledger.ledger.claims import Claim, Free
from kvledger.ledger.collector import collector_paused
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Event, Map
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.limits import REPLAY_COMPACT_EVERY, REPLAY_RETAIN_S
from kvledger.ledger.ownership import Ownership
from kvledger.ledger.partition import partition_of_event
from kvledger.ledger.picture import Picture
from kvledger.ledger.replay import cut, fold_indexed
from kvledger.ledger.summary import state_counts

Slice: TypeAlias = tuple[list[Event], list[int], int, float]
"""One chunk of the whole stream as a partition folds it: the chunk's events of the partition, in
stream order; each one's position in the whole stream (1-based); how many events the chunk held in
the whole stream (every partition's); the newest ts among those (`-inf` when none). What
`slices` makes of decoded chunks and `kvledger.ledger.jsonl.LogReader.partition_chunks` of a log's lines."""


def slices(
    chunks: Iterable[list[Event]],
    partition: int,
    partitions: int,
    *,
    until_seq: int | None = None,
    until_ts: float | None = None,
    stopped: list[bool] | None = None,
) -> Iterator[Slice]:
    """Decoded chunks of the whole stream as `partition`'s slices, cut by `until_seq`/`until_ts` as
    `replay_chunks` cuts them (`stopped` gets True appended when the cut left something out)."""
    if not 0 <= partition < partitions:
        raise ValueError(f"partition {partition} is not in range({partitions})")
    index = 0
    for chunk in chunks:
        if until_ts is not None or until_seq is not None:
            kept = cut(chunk, until_ts, until_seq)
            if len(kept) < len(chunk) and stopped is not None:
                stopped.append(True)
            chunk = kept
        if not chunk:
            continue
        newest = max(e.ts for e in chunk)
        if partitions == 1:
            yield chunk, list(range(index + 1, index + len(chunk) + 1)), len(chunk), newest
        else:
            mine = [(i, e) for i, e in enumerate(chunk, index + 1) if partition_of_event(e, partitions) == partition]
            yield [e for _, e in mine], [i for i, _ in mine], len(chunk), newest
        index += len(chunk)


class Decided(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A release with its event's position in the whole stream and how long its side held the blocks
    (`LatencyRecorder.observe`'s measure, taken where the side was)."""

    index: int
    release: Release
    held_s: float


class Batch(msgspec.Struct, array_like=True, gc=False):
    """What a partition's fold told since its last batch: every item at a stream position up to `upto`
    not told before, each list in index order. A worker sends these as it folds (`fold_partition`'s
    `emit`), so neither it nor the merge holds a log's worth of them."""

    upto: int
    decided: list[Decided]
    frees: list[Free]
    claims: list[Claim]
    expired: list[tuple[int, float]]


BATCH_ITEMS = 8_192
"""Items (releases and accepted maps) a partition's fold gathers before it emits a `Batch`."""


class PartitionAnswer(msgspec.Struct, kw_only=True, array_like=True):
    """What one partition's fold says: the parts `merge` needs (plain data: msgpack round-trips it)."""

    partition: int
    partitions: int
    events: int
    """Events of this partition folded."""
    first_index: int
    first_ts: float | None
    last_ts: float | None
    rest: Batch
    """What no `Batch` told (everything, when the fold emitted none): `upto` is the whole stream's length.
    Its releases only where the fold kept them."""
    latencies: RecorderPlain
    """The partition's latency histograms (counts and maxima: they add up in any order)."""
    findings: list[Finding]
    """The partition's audit at the merged clock, `double_owner` left out."""
    counts: dict[str, Any]
    """`kvledger.ledger.summary.state_counts` of the partition's state."""
    picture: Picture | None = None
    """What a service's page and metrics read besides (a partition worker's answer: `kvledger.ledger.fleet`)."""


class Folded:
    """One partition of a stream, folded (`fold_partition`): what `answer` audits."""

    def __init__(self, partition: int, partitions: int) -> None:
        self.partition, self.partitions = partition, partitions
        self.state = LedgerState()
        self.decided: list[Decided] = []
        self.frees: list[Free] = []
        self.claims: list[Claim] = []
        self.latencies = LatencyRecorder()
        self.expired: list[tuple[int, float]] = []
        self.events = 0
        self.first_index = 0
        """The position of its first event in the whole stream (0: none)."""
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        """The newest ts of its events."""
        self.stream_events = 0
        self.stream_last_ts: float | None = None
        """The newest ts of the whole stream's events: the audit clock's default."""
        self.next_compaction = 0
        """`stream_events` at which the next compaction is due (`fold_partition` with `into` goes on from it)."""

    def take(self, upto: int) -> Batch:
        """The items gathered since the last `take`, as a `Batch` told up to stream position `upto`."""
        batch = Batch(upto, self.decided, self.frees, self.claims, self.expired)
        self.decided, self.frees, self.claims, self.expired = [], [], [], []
        return batch


def fold_partition(
    parts: Iterable[Slice],
    partition: int,
    partitions: int,
    *,
    compact_every: int | None = REPLAY_COMPACT_EVERY,
    keep_releases: bool = True,
    emit: Callable[[Batch], None] | None = None,
    batch_items: int = BATCH_ITEMS,
    into: Folded | None = None,
) -> Folded:
    """Fold one partition's slices of a stream, as `kvledger.ledger.replay.replay_chunks` folds the whole stream
    (the same compaction, after the same chunks, with the same cut), keeping each release's and each
    accepted map's position in the whole stream (the releases themselves only with `keep_releases`). With
    `emit`, they go out in batches of about `batch_items` as the fold goes, the rest in the answer. With
    `into`, the fold goes on from that partition's fold (a consumer's next slices: `kvledger.ledger.fleet`)."""
    if not 0 <= partition < partitions:
        raise ValueError(f"partition {partition} is not in range({partitions})")
    out = Folded(partition, partitions) if into is None else into
    if (out.partition, out.partitions) != (partition, partitions):
        raise ValueError(f"folding partition {partition} of {partitions} into {out.partition} of {out.partitions}")
    state = out.state
    sides_of, compact = state.sides_of, state.compact
    record = out.latencies.record
    released: list[Release] = []
    caused: list[int] = []
    claimed: list[int] = []
    n, mine = out.stream_events, out.events
    next_compaction = out.next_compaction if into is not None else compact_every or 0
    last_ts = out.stream_last_ts if out.stream_last_ts is not None else float("-inf")
    own_last = out.last_ts if out.last_ts is not None else float("-inf")
    with collector_paused():
        for events, indices, stream_events, newest in parts:
            if not stream_events:
                continue
            if events:
                decided, frees, claims, expired = out.decided, out.frees, out.claims, out.expired
                fold_indexed(state, events, released, caused, claimed)
                for k in claimed:
                    m = events[k]
                    assert type(m) is Map
                    claims.append(Claim(indices[k], m.source, m.transfer_id, m.request_id, m.block_ids, m.seq))
                for release, k in zip(released, caused, strict=True):
                    side = sides_of[release.source][release.transfer_id]
                    held_s = record(release, max(0.0, release.ts - side.first_ts))
                    index = indices[k]
                    frees.append(Free(index, release.source, release.transfer_id))
                    if release.cause == "expired":
                        expired.append((index, held_s * len(release.block_ids)))
                    if keep_releases:
                        decided.append(Decided(index, release, held_s))
                released.clear()
                caused.clear()
                claimed.clear()
                if out.first_ts is None:
                    out.first_index, out.first_ts = indices[0], events[0].ts
                own_last = max(own_last, max(e.ts for e in events))
                mine += len(events)
            if newest > last_ts:
                last_ts = newest
            n += stream_events
            if compact_every is not None and n >= next_compaction:
                compact(decided_before_ts=last_ts - REPLAY_RETAIN_S, clean_only=True)
                next_compaction = n + compact_every
            if emit is not None and len(out.frees) + len(out.claims) >= batch_items:
                emit(out.take(n))
    out.events = mine
    out.last_ts = own_last if mine else None
    out.stream_events = n
    out.stream_last_ts = last_ts if n else None
    out.next_compaction = next_compaction
    return out


def answer(folded: Folded, now: float, config: AuditConfig | None = None) -> PartitionAnswer:
    """The partition's answer at the merged clock `now` (the whole log's last ts, or the caller's)."""
    findings = [f for f in audit(folded.state, now, config) if f.code != "double_owner"]
    return PartitionAnswer(
        partition=folded.partition,
        partitions=folded.partitions,
        events=folded.events,
        first_index=folded.first_index,
        first_ts=folded.first_ts,
        last_ts=folded.last_ts,
        rest=folded.take(folded.stream_events),
        latencies=folded.latencies.to_plain(),
        findings=findings,
        counts=state_counts(folded.state),
    )


_index_of = attrgetter("index")
_first = itemgetter(0)


class Merged(msgspec.Struct, kw_only=True):
    """One fold's answer, merged from every partition's."""

    events: int
    first_ts: float | None
    last_ts: float | None
    releases: list[Release]
    findings: list[Finding]
    counts: dict[str, Any]
    latencies: LatencyRecorder


def merge(answers: Iterable[PartitionAnswer]) -> Merged:
    """The answers of every partition of one log (each exactly once, in any order) as one fold's answer."""
    parts = list(answers)
    if not parts:
        raise ValueError("no partition answers to merge")
    merger = Merger(parts[0].partitions)
    return merger.finish(parts)


class Merger:
    """The merge of a log's partitions, fed their batches as they come (`add`) and their answers at the end
    (`finish`). What every partition has told up to a stream position (the least of their `upto`) is
    merged at once in fold order, so it holds only what one partition told ahead of the slowest."""

    def __init__(self, partitions: int) -> None:
        if partitions < 1:
            raise ValueError(f"partitions must be at least 1, got {partitions}")
        self.partitions = partitions
        self.upto = [0] * partitions
        self.pending = [Batch(0, [], [], [], []) for _ in range(partitions)]
        self.merged_upto = 0
        self.releases: list[Release] = []
        self.ownership = Ownership()
        self.expired_block_seconds = 0.0

    def add(self, partition: int, batch: Batch) -> None:
        """`partition`'s next batch."""
        if batch.upto < self.upto[partition]:
            raise ValueError(f"partition {partition} went back from {self.upto[partition]} to {batch.upto}")
        held = self.pending[partition]
        held.decided += batch.decided
        held.frees += batch.frees
        held.claims += batch.claims
        held.expired += batch.expired
        self.upto[partition] = batch.upto
        self._advance()

    def _advance(self) -> None:
        upto = min(self.upto)
        if upto <= self.merged_upto:
            return
        decided: list[Decided] = []
        frees: list[Free] = []
        claims: list[Claim] = []
        expired: list[tuple[int, float]] = []
        for held in self.pending:  # each list is in index order: what is ready is a prefix
            k = bisect_right(held.decided, upto, key=_index_of)
            decided += held.decided[:k]
            del held.decided[:k]
            k = bisect_right(held.frees, upto, key=_index_of)
            frees += held.frees[:k]
            del held.frees[:k]
            k = bisect_right(held.claims, upto, key=_index_of)
            claims += held.claims[:k]
            del held.claims[:k]
            k = bisect_right(held.expired, upto, key=_first)
            expired += held.expired[:k]
            del held.expired[:k]
        # Positions are distinct: one sort in C orders them (a heap merge steps through Python per item).
        decided.sort(key=_index_of)
        frees.sort(key=_index_of)
        claims.sort(key=_index_of)
        expired.sort()
        self.releases += [d.release for d in decided]
        self.ownership.feed(claims, frees)
        total = self.expired_block_seconds
        for _, block_seconds in expired:
            total += block_seconds
        self.expired_block_seconds = total
        self.merged_upto = upto

    def finish(self, answers: list[PartitionAnswer]) -> Merged:
        """Merge with every partition's answer (each exactly once, in any order): one fold's answer."""
        parts = sorted(answers, key=lambda a: a.partition)
        partitions = self.partitions
        if [a.partition for a in parts] != list(range(partitions)) or any(a.partitions != partitions for a in parts):
            raise ValueError(
                f"partition answers {[a.partition for a in parts]} are not each of range({partitions}) once"
            )
        for a in parts:
            self.add(a.partition, a.rest)
        if len(set(self.upto)) != 1:
            raise ValueError(f"partitions read streams of different lengths: {self.upto}")
        findings = [f for a in parts for f in a.findings]
        findings.extend(self.ownership.findings())
        findings.sort(key=finding_order)
        firsts = [a for a in parts if a.first_ts is not None]
        lasts = [a.last_ts for a in parts if a.last_ts is not None]
        latencies = merge_latencies(parts)
        latencies.expired_block_seconds = self.expired_block_seconds
        return Merged(
            events=sum(a.events for a in parts),
            first_ts=min(firsts, key=lambda a: a.first_index).first_ts if firsts else None,
            last_ts=max(lasts) if lasts else None,
            releases=self.releases,
            findings=findings,
            counts=merge_counts([a.counts for a in parts]),
            latencies=latencies,
        )


def merge_latencies(parts: list[PartitionAnswer]) -> LatencyRecorder:
    """The partitions' latency recorders as one fold's: histogram counts added and maxima taken (the same
    in any order). Expired block-seconds are not theirs to add (a float sum depends on its order): the
    merge sums them again in fold order."""
    out = LatencyRecorder()
    for a in parts:
        part = LatencyRecorder.from_plain(a.latencies)
        for kind, histogram in part.by_kind.items():
            _add_histogram(out.by_kind.setdefault(kind, LatencyHistogram()), histogram)
        _add_histogram(out.completed, part.completed)
        _add_histogram(out.all_causes, part.all_causes)
        out.expired_releases += part.expired_releases
    return out


def _add_histogram(into: LatencyHistogram, other: LatencyHistogram) -> None:
    counts = into.counts
    for bucket, n in other.counts.items():
        counts[bucket] = counts.get(bucket, 0) + n
    into.count += other.count
    if other.max_s > into.max_s:
        into.max_s = other.max_s


def merge_counts(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """`state_counts` of several partitions as one state's: counters added, the oldest held the least."""
    out: dict[str, Any] = {}
    for name in ("by_phase", "by_mode", "releases_by_cause", "compaction"):
        total: Counter[str] = Counter()
        for c in counts:
            total.update(c[name])
        order = list(dict.fromkeys(k for c in counts for k in c[name]))
        out[name] = {k: total[k] for k in (sorted(order) if name in ("by_phase", "by_mode") else order)}
    out["live_transfers"] = sum(c["live_transfers"] for c in counts)
    out["blocks_held"] = sum(c["blocks_held"] for c in counts)
    oldest = [c["oldest_held_ts"] for c in counts if c["oldest_held_ts"] is not None]
    out["oldest_held_ts"] = min(oldest) if oldest else None
    return out
