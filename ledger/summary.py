"""The folded picture of a log in plain data: what replay prints and what the service returns."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from kvledger.ledger.audit import SEVERITY_RANK, Finding, counts_by_code
from kvledger.ledger.decisions import Key
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.limits import FINDINGS_WORST_MAX
from kvledger.ledger.transfer_state import TransferState


def summarize(state: LedgerState, findings: list[Finding]) -> dict[str, Any]:
    return summarize_counts(state_counts(state), findings)


def state_counts(state: LedgerState) -> dict[str, Any]:
    """What a summary reads of a state, as plain counts: the counts of a log's partitions add up to the
    whole log's (`kvledger.ledger.partitioned.merge_counts`)."""
    by_phase, by_mode = phase_mode_counts(state.transfers, state.compacted_by_phase, state.compacted_by_mode)
    return {
        "by_phase": {k: v for k, v in sorted(by_phase.items()) if v},
        "by_mode": {k: v for k, v in sorted(by_mode.items()) if v},
        "releases_by_cause": dict(state.releases_by_cause),
        "compaction": compaction_report(state),
        "live_transfers": len(state.live),
        "blocks_held": state.blocks_held,
        "oldest_held_ts": min((t.first_ts for t in state.live.values()), default=None),
    }


def phase_mode_counts(
    transfers: dict[Key, TransferState], compacted_by_phase: dict[str, int], compacted_by_mode: dict[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """The sides by phase and by mode ("unmapped": none), with the compacted ones' counts: one loop over every
    side, compiled with the fold (a partition worker's answer reads it of a state that is never compacted)."""
    by_phase: dict[str, int] = dict(compacted_by_phase)
    by_mode: dict[str, int] = dict(compacted_by_mode)
    for t in transfers.values():
        by_phase[t.phase] = by_phase.get(t.phase, 0) + 1
        mode = t.mode or "unmapped"
        by_mode[mode] = by_mode.get(mode, 0) + 1
    return by_phase, by_mode


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
    """What the memory held, and whether any answer may not be exact (`compaction_warning` says which).

    `tombstones`: compacted sides held; `unstamped_held`: those of unstamped ids, which are never retired
    (memory grows with them; stamped ids, ledger/ids.py, bound it by the id window); `behind_horizon`:
    events that may have named a retired stamped id, judged as new (not exact)."""
    return {
        "tombstones": state.tombstone_count,
        "unstamped_held": state.unstamped_held,
        "behind_horizon": state.behind_horizon,
    }


def compaction_warning(state: LedgerState) -> str | None:
    """A sentence for people when an answer may not be exact (else None), saying exactly what changed.

    Every answer is exact but one: an event inside its stamped id's window that arrived more than
    `arrival_lag_s` behind the upkeep's clock, after the id's tombstone may have been retired (impossible in
    a time-ordered log). It is judged as the first event of a new side, and counted."""
    return compaction_warning_of(compaction_report(state), state.arrival_lag_s)


def compaction_warning_of(report: dict[str, int], arrival_lag_s: float) -> str | None:
    """`compaction_warning` from a `compaction_report` (one state's, or a merge of partitions')."""
    behind_horizon = report["behind_horizon"]
    if not behind_horizon:
        return None
    return (
        f"memory bound hit: {behind_horizon} events arrived more than {arrival_lag_s:g} s behind the "
        "log's clock for stamped transfer ids that may have been retired; each was judged as the first event "
        "of a new side, so the decisions and findings about those are not exact"
    )


def worst_severity(findings: list[Finding]) -> str | None:
    if not findings:
        return None
    return min((f.severity for f in findings), key=SEVERITY_RANK.__getitem__)
