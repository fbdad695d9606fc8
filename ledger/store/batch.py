"""One append's SQL, built per batch: which of its rows are stored already, and each source's highest seq.

Each is one statement for the whole batch (a UNION ALL with a term per source, each term an index
range scan on `(source, seq)`), instead of a statement per source or per event.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from operator import itemgetter

from ledger.store.base import ConflictError
from ledger.store.rows import Row

SOURCES_PER_QUERY = 200
"""Sources per statement: SQLite allows 500 terms in one compound SELECT."""

_source, _seq = itemgetter(0), itemgetter(1)


def batch_keys(rows: list[Row]) -> tuple[dict[str, tuple[int, int]], bool]:
    """The lowest and highest seq of each source in `rows`, and whether no (source, seq) repeats.

    Sorting the keys and building dicts from them runs in C: a loop over the rows in Python cost
    a fifth of what the whole append costs (benchmarks/store.py)."""
    keys = list(zip(map(_source, rows), map(_seq, rows), strict=True))
    ordered = sorted(keys)
    highs = dict(ordered)  # the last pair of each source wins: its highest seq
    lows = dict(reversed(ordered))
    return {source: (lows[source], high) for source, high in highs.items()}, len(set(keys)) == len(keys)


def chunks(ranges: dict[str, tuple[int, int]]) -> Iterator[list[tuple[str, tuple[int, int]]]]:
    items = list(ranges.items())
    for first in range(0, len(items), SOURCES_PER_QUERY):
        yield items[first : first + SOURCES_PER_QUERY]


@lru_cache(maxsize=64)
def stored_rows_sql(sources: int, mark: str) -> str:
    """(source, seq, body) of the stored rows in each of `sources` (source, low, high) ranges."""
    term = f"SELECT source, seq, body FROM events WHERE source = {mark} AND seq BETWEEN {mark} AND {mark}"
    return " UNION ALL ".join([term] * sources)


@lru_cache(maxsize=64)
def max_seq_sql(sources: int, mark: str) -> str:
    """(source, highest stored seq or NULL) for each of `sources` sources, each given twice."""
    term = f"SELECT {mark}, (SELECT max(seq) FROM events WHERE source = {mark})"
    return " UNION ALL ".join([term] * sources)


def fresh_indices(rows: list[Row], stored: dict[tuple[str, int], bytes], unique: bool, where: str) -> list[int]:
    """Positions of the rows to insert: not stored yet, and the first of any repeated in the batch
    (`unique`: none is).

    Raises ConflictError naming the event when a (source, seq) is stored, or repeated in the batch,
    with a different body: then nothing of the batch may be written."""
    if not stored and unique:
        return list(range(len(rows)))  # the common case: everything is new
    fresh: list[int] = []
    for i, row in enumerate(rows):
        key = (row[0], row[1])
        body = stored.get(key)
        if body is None:
            stored[key] = row[5]
            fresh.append(i)
        elif body != row[5]:
            raise ConflictError(f"{where}: {row[0]!r} seq {row[1]} is stored with different content")
    return fresh
