"""The folded picture of a log in plain data: what replay prints and what the service returns."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from ledger.audit import SEVERITY_RANK, Finding, counts_by_code
from ledger.fold import LedgerState
from ledger.limits import FINDINGS_WORST_MAX


def summarize(state: LedgerState, findings: list[Finding]) -> dict[str, Any]:
    by_phase: Counter[str] = Counter(state.compacted_by_phase)
    by_mode: Counter[str] = Counter(state.compacted_by_mode)
    for t in state.transfers.values():
        by_phase[t.phase] += 1
        by_mode[t.mode or "unmapped"] += 1
    oldest = min((t.first_ts for t in state.live.values()), default=None)
    return {
        "transfers": sum(by_phase.values()),
        "transfers_by_phase": dict(sorted(by_phase.items())),
        "transfers_by_mode": dict(sorted(by_mode.items())),
        "releases_by_cause": {k: v for k, v in state.releases_by_cause.items() if v},
        "live_transfers": len(state.live),
        "blocks_held": state.blocks_held,
        "oldest_held_ts": oldest,
        "findings_by_code": {k: v for k, v in counts_by_code(findings).items() if v},
        "findings_by_severity": dict(Counter(f.severity for f in findings)),
        "late_after_compaction": state.late_after_compaction,
        "worst": [msgspec.to_builtins(f) for f in findings[:FINDINGS_WORST_MAX]],
    }


def worst_severity(findings: list[Finding]) -> str | None:
    if not findings:
        return None
    return min((f.severity for f in findings), key=SEVERITY_RANK.__getitem__)
