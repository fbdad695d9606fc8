"""Merge several sources' logs into one fold order: by ts, then source, then seq.

Each input keeps its own order (a source's log is already in seq order), so the
merge never reorders events of one source even where wall clocks step back.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from ledger.events import Event


class OverlapError(ValueError):
    """Two inputs hold the same (source, seq): logs of two different ledgers merged by mistake."""


def merge(streams: Iterable[Iterable[Event]], names: list[str] | None = None) -> Iterator[Event]:
    """Interleave event streams by (ts, source, seq); raise `OverlapError` on a repeated (source, seq)."""
    inputs = list(streams)
    labels = names or [f"input {i + 1}" for i in range(len(inputs))]
    owner: dict[str, int] = {}
    last: dict[str, int] = {}
    tagged = [_tag(stream, i) for i, stream in enumerate(inputs)]
    for _, source, seq, i, event in heapq.merge(*tagged, key=lambda item: item[:4]):
        first = owner.setdefault(source, i)
        if first != i or seq <= last.get(source, 0):
            raise OverlapError(
                f"source {source!r} seq {seq} appears in both {labels[first]} and {labels[i]}: "
                "these logs overlap (two copies of one log, or two ledgers with the same source name)"
                if first != i
                else f"source {source!r} seq {seq} is out of order in {labels[i]}"
            )
        last[source] = seq
        yield event


def _tag(stream: Iterable[Event], index: int) -> Iterator[tuple[float, str, int, int, Event]]:
    for e in stream:
        yield (e.ts, e.source, e.seq, index, e)
