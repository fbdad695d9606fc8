"""The folded picture of a log in plain data: what replay prints and what the service returns."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from kvledger.ledger.audit import SEVERITY_RANK, Finding, counts_by_code
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.limits import FINDINGS_WORST_MAX


def summarize(state: LedgerState, findings: list[Finding]) -> dict[str, Any]:
    by_phase: Counter[str] = Counter(state.compacted_by_phase)
    by_mode: Counter[str] = Counter(state.compacted_by_mode)
    for t in state.transfers.values():
        by_phase[t.phase] += 1
        by_mode[t.mode or "unmapped"] += 1
    oldest = min((t.first_ts for t in state.live.values()), default=None)
    return {
        "transfers": sum(by_phase.values()),
        "transfers_by_phase": {k: v for k, v in sorted(by_phase.items()) if v},
        "transfers_by_mode": {k: v for k, v in sorted(by_mode.items()) if v},
        "releases_by_cause": {k: v for k, v in state.releases_by_cause.items() if v},
        "live_transfers": len(state.live),
        "blocks_held": state.blocks_held,
        "oldest_held_ts": oldest,
        "findings_by_code": {k: v for k, v in counts_by_code(findings).items() if v},
        "findings_by_severity": dict(Counter(f.severity for f in findings)),
        "compaction": compaction_report(state),
        "worst": [msgspec.to_builtins(f) for f in findings[:FINDINGS_WORST_MAX]],
    }


def compaction_report(state: LedgerState) -> dict[str, int]:
    """How much the bounded memory held and whether its bounds were hit (then some answers are approximate:
    `compaction_warning` says which)."""
    return {
        "tombstones": state.tombstone_count,
        "tombstones_evicted": state.tombstones_evicted,
        "orphans_evicted": state.orphans_evicted,
        "late_after_eviction": state.late_after_eviction,
        "reused_after_eviction": state.reused_after_eviction,
        "sides_unchecked": state.sides_unchecked,
    }


def compaction_warning(state: LedgerState) -> str | None:
    """A sentence for people when a memory bound was hit (else None), saying exactly what it changed.

    Past the tombstone bound, events that fell on an evicted side are counted, not judged (a map refused on
    the id memory's word). Past the orphan bound, no id of an evicted never-mapped side is kept: a side first
    seen after that may be one of them, taken for a new transfer where the whole history decides it as the
    orphan (a map released at once, as expired before it), so every such side is counted as unchecked."""
    if not state.tombstones_evicted and not state.orphans_evicted:
        return None
    parts: list[str] = []
    exact = True
    if state.tombstones_evicted:
        head = f"{state.tombstones_evicted} compacted transfer sides evicted past {state.tombstones_max} tombstones"
        if state.late_after_eviction or state.reused_after_eviction:
            exact = False
            head += (
                f": {state.late_after_eviction} later events for them were counted, not judged, and "
                f"{state.reused_after_eviction} maps of their ids were refused on the id memory's word"
            )
        else:
            head += ": no later event fell on them"
        parts.append(head)
    if state.orphans_evicted:
        head = (
            f"{state.orphans_evicted} never-mapped sides evicted past {state.orphan_tombstones_max}, their ids "
            "forgotten"
        )
        if state.sides_unchecked:
            exact = False
            head += (
                f": {state.sides_unchecked} sides first seen after that could not be checked against them (one "
                "that names an evicted side is taken for a new transfer, its map held until released or expired, "
                "where the whole history releases it at once as expired before its map)"
            )
        else:
            head += ": no side was first seen after that"
        parts.append(head)
    tail = "every finding and decision is exact" if exact else "the decisions and findings about those are not exact"
    return f"memory bound hit: {'; '.join(parts)}; so {tail}"


def worst_severity(findings: list[Finding]) -> str | None:
    if not findings:
        return None
    return min((f.severity for f in findings), key=SEVERITY_RANK.__getitem__)
