"""The folded picture of a log in plain data: what replay prints and what the service returns."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from kvledger.ledger.audit import SEVERITY_RANK, Finding, counts_by_code
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.limits import FINDINGS_WORST_MAX


def summarize(state: LedgerState, findings: list[Finding]) -> dict[str, Any]:
    return summarize_counts(state_counts(state), findings)


def state_counts(state: LedgerState) -> dict[str, Any]:
    """What a summary reads of a state, as plain counts: the counts of a log's partitions add up to the
    whole log's (`kvledger.ledger.partitioned.merge_counts`)."""
    by_phase: Counter[str] = Counter(state.compacted_by_phase)
    by_mode: Counter[str] = Counter(state.compacted_by_mode)
    for t in state.transfers.values():
        by_phase[t.phase] += 1
        by_mode[t.mode or "unmapped"] += 1
    return {
        "by_phase": {k: v for k, v in sorted(by_phase.items()) if v},
        "by_mode": {k: v for k, v in sorted(by_mode.items()) if v},
        "releases_by_cause": dict(state.releases_by_cause),
        "compaction": compaction_report(state),
        "live_transfers": len(state.live),
        "blocks_held": state.blocks_held,
        "oldest_held_ts": min((t.first_ts for t in state.live.values()), default=None),
    }


def summarize_counts(counts: dict[str, Any], findings: list[Finding]) -> dict[str, Any]:
    """The summary of a state whose `state_counts` are `counts`, with its audit's `findings`."""
    by_phase: dict[str, int] = counts["by_phase"]
    return {
        "transfers": sum(by_phase.values()),
        "transfers_by_phase": {k: v for k, v in by_phase.items() if v},
        "transfers_by_mode": {k: v for k, v in counts["by_mode"].items() if v},
        "releases_by_cause": {k: v for k, v in counts["releases_by_cause"].items() if v},
        "live_transfers": counts["live_transfers"],
        "blocks_held": counts["blocks_held"],
        "oldest_held_ts": counts["oldest_held_ts"],
        "findings_by_code": {k: v for k, v in counts_by_code(findings).items() if v},
        "findings_by_severity": dict(Counter(f.severity for f in findings)),
        "compaction": counts["compaction"],
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
    return compaction_warning_of(compaction_report(state), state.tombstones_max, state.orphan_tombstones_max)


def compaction_warning_of(report: dict[str, int], tombstones_max: int, orphan_tombstones_max: int) -> str | None:
    """`compaction_warning` from a `compaction_report` (one state's, or a merge of partitions')."""
    tombstones_evicted, orphans_evicted = report["tombstones_evicted"], report["orphans_evicted"]
    if not tombstones_evicted and not orphans_evicted:
        return None
    parts: list[str] = []
    exact = True
    if tombstones_evicted:
        head = f"{tombstones_evicted} compacted transfer sides evicted past {tombstones_max} tombstones"
        if report["late_after_eviction"] or report["reused_after_eviction"]:
            exact = False
            head += (
                f": {report['late_after_eviction']} later events for them were counted, not judged, and "
                f"{report['reused_after_eviction']} maps of their ids were refused on the id memory's word"
            )
        else:
            head += ": no later event fell on them"
        parts.append(head)
    if orphans_evicted:
        head = f"{orphans_evicted} never-mapped sides evicted past {orphan_tombstones_max}, their ids forgotten"
        if report["sides_unchecked"]:
            exact = False
            head += (
                f": {report['sides_unchecked']} sides first seen after that could not be checked against them (one "
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
