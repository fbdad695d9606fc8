"""Merge several sources' logs into one fold order: by ts, then source, then seq.

Each input keeps its own order (a source's log is already in seq order), so the
merge never reorders events of one source even where wall clocks step back: at
every step the smallest of the inputs' next events goes out, as `heapq.merge` does.
The merge works on decoded chunks and hands chunks on, so a replay of several logs
pays one heap step per event and no generator step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from itertools import islice

from kvledger.ledger.events import Event
from kvledger.ledger.limits import REPLAY_BATCH_EVENTS


class OverlapError(ValueError):
    """Two inputs hold the same (source, seq): logs of two different ledgers merged by mistake."""


def merge(streams: Iterable[Iterable[Event]], names: list[str] | None = None) -> Iterator[Event]:
    """Interleave event streams by (ts, source, seq); raise `OverlapError` on a repeated (source, seq)."""
    for chunk in merge_chunks([batched(stream) for stream in streams], names):
        yield from chunk


def batched(events: Iterable[Event], size: int = REPLAY_BATCH_EVENTS) -> Iterator[list[Event]]:
    """`events` in lists of up to `size`."""
    it = iter(events)
    return iter(lambda: list(islice(it, size)), [])


def merge_chunks(
    streams: Iterable[Iterable[list[Event]]], names: list[str] | None = None, *, size: int = REPLAY_BATCH_EVENTS
) -> Iterator[list[Event]]:
    """`merge` over streams of event lists, yielding lists of up to `size` events."""
    inputs = [iter(stream) for stream in streams]
    labels = names or [f"input {i + 1}" for i in range(len(inputs))]
    chunks: list[list[Event]] = []
    positions: list[int] = []
    heads: list[tuple[float, str, int, int]] = []
    for i, stream in enumerate(inputs):
        chunk = next((c for c in stream if c), [])
        chunks.append(chunk)
        positions.append(0)
        if chunk:
            first = chunk[0]
            heads.append((first.ts, first.source, first.seq, i))
    heapq.heapify(heads)
    owner: dict[str, int] = {}
    last: dict[str, int] = {}
    out: list[Event] = []
    heapreplace, heappop = heapq.heapreplace, heapq.heappop
    while heads:
        _, source, seq, i = heads[0]
        chunk, position = chunks[i], positions[i]
        if owner.setdefault(source, i) != i or seq <= last.get(source, 0):
            raise _overlap(source, seq, labels, owner[source], i)
        last[source] = seq
        out.append(chunk[position])
        position += 1
        if position == len(chunk):
            chunk = next((c for c in inputs[i] if c), [])
            chunks[i], position = chunk, 0
        positions[i] = position
        if chunk:
            following = chunk[position]
            heapreplace(heads, (following.ts, following.source, following.seq, i))
        else:
            heappop(heads)
        if len(out) >= size:
            yield out
            out = []
    if out:
        yield out


def _overlap(source: str, seq: int, labels: list[str], first: int, this: int) -> OverlapError:
    if first != this:
        return OverlapError(
            f"source {source!r} seq {seq} appears in both {labels[first]} and {labels[this]}: "
            "these logs overlap (two copies of one log, or two ledgers with the same source name)"
        )
    return OverlapError(f"source {source!r} seq {seq} is out of order in {labels[this]}")
