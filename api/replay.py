"""Replay an uploaded incident log (JSONL or a SQLite ledger file) offline with the ledger's own replay."""

from __future__ import annotations

from pathlib import Path

from kvledger.api.errors import InvalidBody
from kvledger.api.schemas import ReplayOut
from kvledger.api.views import finding_out, release_out
from kvledger.ledger.audit import AuditConfig, audit, counts_by_code
from kvledger.ledger.inputs import Inputs
from kvledger.ledger.jsonl import LogFormatError
from kvledger.ledger.merge import OverlapError
from kvledger.ledger.replay import ReplayResult, replay_chunks
from kvledger.ledger.store.base import StoreError
from kvledger.ledger.summary import summarize


def _replay(path: Path, until_seq: int | None, until_ts: float | None) -> ReplayResult:
    """`kvledger replay` on the file; format errors become `InvalidBody` naming the line or the file."""
    try:
        with Inputs([path]) as inputs:
            return replay_chunks(inputs.chunks(), until_seq=until_seq, until_ts=until_ts)
    except LogFormatError as error:
        raise InvalidBody(("body", f"line {error.line}"), error.message) from None
    except (StoreError, OverlapError) as error:
        raise InvalidBody(("body",), f"SQLite file is not a usable kvledger store: {error}") from None


def replay_file(
    path: Path, *, until_seq: int | None, until_ts: float | None, limit: int, config: AuditConfig
) -> ReplayOut:
    """Fold the file's events up to the given seq (per source) and ts; audit at `until_ts` or the last ts."""
    result = _replay(path, until_seq, until_ts)
    state = result.state
    now = until_ts if until_ts is not None else (result.last_ts or 0.0)
    findings = audit(state, now, config)
    summary = summarize(state, findings)
    return ReplayOut(
        events=result.events,
        sources=sorted(state.sources),
        transfers=summary["transfers"],
        phases=summary["transfers_by_phase"],
        live_transfers=len(state.live),
        blocks_held=state.blocks_held,
        releases_by_cause={str(k): v for k, v in state.releases_by_cause.items()},
        decisions=[release_out(r) for r in result.releases[:limit]],
        decisions_total=result.release_count,
        now=now,
        counts=counts_by_code(findings),
        findings=[finding_out(f) for f in findings[:limit]],
        findings_total=len(findings),
    )
