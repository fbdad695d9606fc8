"""The folded picture of a log in plain data: what replay prints and what the service returns."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from ledger.audit import SEVERITY_RANK, Finding, counts_by_code
from ledger.fold import LedgerState
from ledger.limits import FINDINGS_WORST_MAX


def summarize(state: LedgerState, findings: list[Finding]) -> dict[str, Any]:
    return summarize_counts(state_counts(state), findings)


def state_counts(state: LedgerState) -> dict[str, Any]:
    """What a summary reads of a state, as plain counts (partitions' counts add up: ledger.partitioned)."""
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
    """What the memory held and retired, and whether any event came too far behind to be judged exactly
    (`behind_horizon`: the one case where the memory bound can change an answer)."""
    return {
        "tombstones": state.tombstone_count,
        "tombstones_retired": state.tombstones_retired,
        "orphans_retired": state.orphans_retired,
        "ids_remembered": state.id_memory.added if state.id_memory is not None else 0,
        "late_after_horizon": state.late_after_horizon,
        "reused_after_horizon": state.reused_after_horizon,
        "behind_horizon": state.behind_horizon,
    }


def compaction_warning(state: LedgerState) -> str | None:
    return compaction_warning_of(compaction_report(state))


def compaction_warning_of(report: dict[str, int]) -> str | None:
    """A sentence for people when the memory bound may have changed an answer (else None: every decision
    and finding is what a fold that never forgets gives, under the horizon rule)."""
    behind = report.get("behind_horizon", 0)
    if not behind:
        return None
    return (
        f"{behind} events for retired transfer sides came more than the arrival lag behind the newest event: "
        "their sides may have been retired before their horizon, so those events were counted (a map refused, "
        "anything else late), not judged in full; every other decision and finding is exact"
    )


def worst_severity(findings: list[Finding]) -> str | None:
    if not findings:
        return None
    return min((f.severity for f in findings), key=SEVERITY_RANK.__getitem__)
