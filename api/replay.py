"""Replay an uploaded incident log (JSONL or a SQLite ledger file) offline: fold it, decide, audit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from api.errors import InvalidBody
from api.schemas import ReplayOut
from api.views import finding_out, release_out
from ledger.audit import AuditConfig, audit, counts_by_code
from ledger.events import Event
from ledger.fold import fold_all
from ledger.jsonl import LogFormatError, LogReader
from ledger.store.base import StoreError
from ledger.store.connect import open_store

SQLITE_MAGIC = b"SQLite format 3\x00"


def _events(path: Path) -> Iterator[Event]:
    """The file's events in its own order; format errors become `InvalidBody` naming the line or file."""
    with open(path, "rb") as file:
        is_sqlite = file.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    if is_sqlite:
        try:
            store = open_store(str(path))
        except StoreError as error:
            raise InvalidBody(("body",), f"SQLite file is not a usable kvledger store: {error}") from None
        try:
            yield from store.read()
        except StoreError as error:
            raise InvalidBody(("body",), f"SQLite file could not be read: {error}") from None
        finally:
            store.close()
        return
    with open(path, "rb") as file:
        try:
            yield from LogReader(file, "upload")
        except LogFormatError as error:
            raise InvalidBody(("body", f"line {error.line}"), error.message) from None


def replay_file(
    path: Path, *, until_seq: int | None, until_ts: float | None, limit: int, config: AuditConfig
) -> ReplayOut:
    """Fold the file's events up to the given seq (per source) and ts; audit at `until_ts` or the last ts."""
    sources: Counter[str] = Counter()
    last_ts = 0.0

    def chosen() -> Iterator[Event]:
        nonlocal last_ts
        for event in _events(path):
            if (until_seq is not None and event.seq > until_seq) or (until_ts is not None and event.ts > until_ts):
                continue
            sources[event.source] += 1
            last_ts = max(last_ts, event.ts)
            yield event

    state, releases = fold_all(chosen())
    now = until_ts if until_ts is not None else last_ts
    findings = audit(state, now, config)
    phases = Counter(str(t.phase) for t in state.transfers.values())
    return ReplayOut(
        events=sum(sources.values()),
        sources=sorted(sources),
        transfers=len(state.transfers),
        phases=dict(phases),
        live_transfers=len(state.live),
        blocks_held=state.blocks_held,
        releases_by_cause={str(k): v for k, v in state.releases_by_cause.items()},
        decisions=[release_out(r) for r in releases[:limit]],
        decisions_total=len(releases),
        now=now,
        counts=counts_by_code(findings),
        findings=[finding_out(f) for f in findings[:limit]],
        findings_total=len(findings),
    )
