"""One append's SQL, built per batch: which of its rows are stored already, each source's highest seq, and
the store's highest cursor.

All three in one statement for the whole batch (a UNION ALL with two terms per source, each an index range
scan or lookup on `(source, seq)`), instead of a statement per source or per event: a statement costs a
round trip to PostgreSQL and tens of microseconds of SQLAlchemy on either backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from operator import itemgetter

from kvledger.ledger.store.base import ConflictError
from kvledger.ledger.store.rows import Row

SOURCES_PER_QUERY = 150
"""Sources per statement: SQLite allows 500 terms in one compound SELECT, and before 3.32 999 parameters
(five per source)."""

STORED, HIGHEST, CURSOR = 0, 1, 2
"""The tag in the first column of each row of `lookup_sql`: what the row says."""

_source, _seq = itemgetter(0), itemgetter(1)


def batch_keys(rows: list[Row]) -> tuple[dict[str, tuple[int, int]], bool]:
    """The lowest and highest seq of each source in `rows`, and whether no (source, seq) repeats.

    Sorting the keys and building dicts from them runs in C: a loop over the rows in Python cost
    a fifth of what the whole append costs (benchmarks/store.py)."""
    sources, seqs = list(map(_source, rows)), list(map(_seq, rows))
    if sources and sources.count(sources[0]) == len(sources):  # one source (an ingest batch): no sort needed
        return {sources[0]: (min(seqs), max(seqs))}, len(set(seqs)) == len(seqs)
    keys = list(zip(sources, seqs, strict=True))
    ordered = sorted(keys)
    highs = dict(ordered)  # the last pair of each source wins: its highest seq
    lows = dict(reversed(ordered))
    return {source: (lows[source], high) for source, high in highs.items()}, len(set(keys)) == len(keys)


def chunks(ranges: dict[str, tuple[int, int]]) -> Iterator[list[tuple[str, tuple[int, int]]]]:
    items = list(ranges.items())
    for first in range(0, len(items), SOURCES_PER_QUERY):
        yield items[first : first + SOURCES_PER_QUERY]


def lookup_params(chunk: list[tuple[str, tuple[int, int]]]) -> tuple[str | int, ...]:
    """The parameters of `lookup_sql(len(chunk), ...)`: (source, low, high, source, source) per source."""
    return tuple(value for source, (low, high) in chunk for value in (source, low, high, source, source))


@lru_cache(maxsize=64)
def lookup_sql(sources: int, mark: str) -> str:
    """(tag, source, seq, body) rows for `sources` (source, low, high) ranges: tagged STORED, each stored row
    in a range; tagged HIGHEST, each source and its highest stored seq (NULL: none); tagged CURSOR, the
    store's highest cursor (NULL: empty) as the seq."""
    stored = f"SELECT {STORED}, source, seq, body FROM events WHERE source = {mark} AND seq BETWEEN {mark} AND {mark}"
    highest = f"SELECT {HIGHEST}, {mark}, (SELECT max(seq) FROM events WHERE source = {mark}), NULL"
    cursor = f"SELECT {CURSOR}, NULL, (SELECT max(cursor) FROM events), NULL"
    return " UNION ALL ".join([stored, highest] * sources + [cursor])


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
