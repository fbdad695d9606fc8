"""What the service keeps beside the fold as it folds the store's rows, event by event: the sides in
first-seen order, the request index, the counts by kind, each source's newest ts, the blocks-held series and
the release latencies.

One loop with the fold's own `apply` in it, compiled with the fold (setup.py, ledger/projection.pxd), the
same file interpreted where nothing is compiled. Interpreted (it was `kvledger.api.live.Live._fold_rows`), this
bookkeeping was four tenths of the time an ingested batch's fold took on the event loop (benchmarks/api.py).
Sans-IO like the fold: an event that raises is handed back with its error for the caller to count and log,
and the rest of the rows are folded.
"""

from __future__ import annotations

from collections.abc import Callable

from kvledger.ledger.advice import LatencyRecorder
from kvledger.ledger.decisions import Key, Release
from kvledger.ledger.events import KIND_OF_TYPE, Event, Map
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.series import HoldingSeries

ReleaseHook = Callable[[Release, float], None]
"""Told of each release as it is folded, with how long its side held the blocks (seconds)."""


def fold_rows(
    state: LedgerState,
    rows: list[tuple[int, Event]],
    by_kind: dict[str, int],
    last_ts: dict[str, float],
    order: list[Key],
    by_request: dict[str, tuple[Key, ...]],
    holding: HoldingSeries,
    latency: LatencyRecorder,
    on_release: ReleaseHook | None,
) -> list[tuple[int, Event, Exception]]:
    """Fold `rows` (cursor, event) into `state` in order and keep the rest up to date with them: `by_kind`
    counts each kind, `last_ts` each source's newest ts, `order` gets each new side's key, `by_request` each
    map's request, `holding` the blocks held after each map and release, `latency` each release. Returns the
    rows whose event raised, with the error (the fold never raises; this is the guard should it ever)."""
    fold = state
    transfers, held = state.transfers, state.held
    failed: list[tuple[int, Event, Exception]] = []
    for row in rows:
        cursor, event = row
        try:
            envelope = event
            source, ts, cls = envelope.source, envelope.ts, type(event)
            key: Key = (source, envelope.transfer_id)
            sides = len(transfers)
            release = fold.apply(event)
            by_kind[KIND_OF_TYPE[cls]] += 1
            if ts > last_ts.get(source, 0.0):
                last_ts[source] = ts
            # The fold adds one side at most, the event's own, and never drops one: a count tells, where a
            # lookup of the key before the fold was a probe of a million-entry dict (a cache miss) per event.
            if len(transfers) != sides:
                order.append(key)
            if cls is Map:
                mapped: Map = event  # type: ignore[assignment]
                request_id = mapped.request_id
                keys = by_request.get(request_id, ())
                if key not in keys:
                    by_request[request_id] = (*keys, key)
            if cls is Map or release is not None:  # what changes the blocks held
                holding.observe(ts, source, len(held.get(source, ())))
            if release is not None:
                latency_s = latency.observe(release, transfers[key])
                if on_release is not None:
                    on_release(release, latency_s)
        except Exception as error:
            failed.append((cursor, event, error))
    return failed
