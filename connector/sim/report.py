"""How a storm is shown: a side-by-side table against the naive baseline, a full account, one JSON line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvledger.connector.sim.config import StormResult
from kvledger.connector.sim.limits import SOAK_REPLAY_COMPACT_EVERY
from kvledger.connector.sim.soak_config import SoakResult

TABLE_ROWS: tuple[tuple[str, str, str | None], ...] = (
    ("blocks stranded at the end", "leaked_blocks", "naive_leaked_blocks"),
    ("request sides hung (never finished)", "hung_requests", "naive_hung_requests"),
    ("acks dropped (arrived before their map)", "", "naive_dropped_acks"),
    ("double releases", "double_releases", None),
    ("premature releases (audit)", "premature_releases", None),
    ("received bytes that differ", "integrity_failures", None),
    ("failures reported as received", "failed_reported_as_received", None),
)
"""(label, kvledger field, naive field). An empty field is a rule kvledger does not have; None is a figure
the naive model does not produce."""


def _cell(result: StormResult, name: str | None) -> str:
    if name is None:
        return "-"
    if not name:
        return "0"
    return str(getattr(result, name))


def side_by_side(results: Sequence[StormResult]) -> str:
    """kvledger next to naive bookkeeping fed the same observations, one column pair per storm."""
    heads = [f"{r.mode.upper()} seed {r.seed}" for r in results]
    label_width = max(len(row[0]) for row in TABLE_ROWS)
    cell_width = max(10, *(len(h) // 2 + 1 for h in heads))
    top = " " * label_width + "".join(f" | {h:^{2 * cell_width + 3}}" for h in heads)
    sub = " " * label_width + "".join(f" | {'kvledger':>{cell_width}} | {'naive':>{cell_width}}" for _ in heads)
    lines = [top, sub, "-" * len(sub)]
    for label, mine, naive in TABLE_ROWS:
        cells = "".join(f" | {_cell(r, mine):>{cell_width}} | {_cell(r, naive):>{cell_width}}" for r in results)
        lines.append(f"{label:<{label_width}}{cells}")
    return "\n".join(lines)


def account(result: StormResult) -> list[str]:
    """Everything one storm found, in words (what `--seed N` prints)."""
    r = result
    lines = [
        f"seed {r.seed} {r.mode.upper()}: {r.requests} requests at concurrency {r.concurrency}, "
        f"{r.rounds} rounds ({r.sim_seconds:.2f} simulated s) in {r.wall_seconds:.2f} s, {r.events} events",
        f"  faults injected: {r.faults_injected}",
        *_outcome_lines(r, "requests never issued"),
    ]
    return _closing_lines(r, lines)


def _outcome_lines(r: StormResult, unserved: str) -> list[str]:
    """What vLLM was told, the checksums, the audit and the replay: the same words for a storm and a soak."""
    return [
        f"  vLLM told: {r.finished_sending} finished sending, {r.finished_recving} finished receiving "
        f"({r.failed_recving} of them failed loads); {r.lost_requests} request sides died with their engine, "
        f"{r.unserved_requests} {unserved}",
        f"  integrity: {r.integrity_checked} completed receives checked block by block, {r.integrity_failures} differ",
        f"  audit of the merged log: {r.findings} (on the dead engine: {r.findings_on_dead_engine})",
        f"  offline replay reproduces every source's releases in order: {r.replay_matches}",
        f"  forged releases: {r.forged_sent} sent, {r.forged_messages_accepted} accepted; "
        f"longest hook call {r.hook_us_max:.0f} us",
    ]


def _closing_lines(r: StormResult, lines: list[str]) -> list[str]:
    lines.append(f"  fingerprint {r.fingerprint}" + (f", incident log {r.incident_log}" if r.incident_log else ""))
    for finding in r.unexplained_findings:
        lines.append(f"  unexplained finding: {finding}")
    lines.append("  PASS" if r.ok else "  FAIL: " + "; ".join(r.problems))
    return lines


def soak_account(result: SoakResult) -> list[str]:
    """Everything one soak found, in words."""
    r = result
    answers = ", ".join(f"{k} {v}" for k, v in r.id_reuse_answers.items()) or "none"
    lines = [
        f"soak seed {r.seed} {r.mode.upper()}: {r.sim_hours:.2f} simulated hours ({r.stepped_seconds:.0f} s of it "
        f"stepped in {r.rounds} rounds, {r.jumps} jumps across idle time) in {r.wall_seconds:.1f} s; "
        f"{r.requests} requests in {r.bursts} bursts, {r.events} events",
        f"  faults injected: {r.faults_injected}",
        f"  re-asks: {r.reasks} after a load (preempted), {r.recomputes} after a failed load (recompute), "
        f"{r.local_computes} computed locally; requests that loaded twice: {r.loaded_twice}; "
        f"second update_state_after_alloc claiming again: {r.second_alloc_claims}",
        f"  reused transfer ids: {r.id_reuses} requests; refused {r.id_reuses_refused} (known as: {answers}); "
        f"{r.reuses_across_restart} refused by an engine restarted since it used the id; wrongly accepted "
        f"{len(r.reuses_wrongly_accepted)}, refused though never used {len(r.unmapped_ids_refused)}",
        f"  restarts: {r.restarts}; a reopened engine held at most {r.refold_tracked_sides} sides before its "
        f"first step",
        f"  memory: peak {r.peak_tracked_sides} tracked sides (bound {r.tracked_sides_bound}); per ledger "
        f"{r.peak_tracked_sides_per_ledger} (bound {r.tracked_sides_bound_per_ledger}); "
        f"{r.tombstone_generations} tombstone generations evicted",
        *_outcome_lines(r, "requests nobody could serve (a READ producer was down)"),
        f"  same releases and findings with compaction (default; every {SOAK_REPLAY_COMPACT_EVERY} events) and "
        f"without: {r.compaction_invariant} (the default replay compacted {r.replay_compacted_sides} sides)",
    ]
    if r.bookkeeping_left:
        lines.append(f"  left behind: {r.bookkeeping_left}")
    return _closing_lines(r, lines)


def soak_figures(results: Sequence[SoakResult]) -> dict[str, Any]:
    """The soak benchmark's JSON figures: counts summed over its soaks, the peak against its bound."""

    def summed(name: str) -> int:
        return sum(int(getattr(r, name)) for r in results)

    return {
        "sim_hours": round(min((r.sim_hours for r in results), default=0.0), 3),
        "soaks": len(results),
        "modes": sorted({r.mode for r in results}),
        "seeds": _seed_span(sorted({r.seed for r in results})),
        "requests": summed("requests"),
        "events": summed("events"),
        "reasks": summed("reasks"),
        "recomputes": summed("recomputes"),
        "loaded_twice": summed("loaded_twice"),
        "id_reuses": summed("id_reuses"),
        "id_reuses_refused": sum(sum(r.id_reuses_refused.values()) for r in results),
        "reuses_across_restart": summed("reuses_across_restart"),
        "restarts": sum(sum(r.restarts.values()) for r in results),
        "leaked_blocks": summed("leaked_blocks"),
        "double_releases": summed("double_releases"),
        "premature_releases": summed("premature_releases"),
        "hung_requests": summed("hung_requests"),
        "corrupt_receives": summed("integrity_failures") + summed("failed_reported_as_received"),
        "replay_matches": all(r.replay_matches for r in results),
        "compaction_invariant": all(r.compaction_invariant for r in results),
        "peak_tracked_sides": max((r.peak_tracked_sides for r in results), default=0),
        "tracked_sides_bound": min((r.tracked_sides_bound for r in results), default=0),
        "peak_tracked_sides_per_ledger": max(
            (n for r in results for n in r.peak_tracked_sides_per_ledger.values()), default=0
        ),
        "tracked_sides_bound_per_ledger": min((r.tracked_sides_bound_per_ledger for r in results), default=0),
        "tombstone_generations": summed("tombstone_generations"),
        "failed_soaks": sum(1 for r in results if not r.ok),
        "wall_seconds": round(sum(r.wall_seconds for r in results), 1),
    }


def _seed_span(seeds: list[int]) -> str:
    """`1-200` for a contiguous range, else the seeds comma-separated."""
    if seeds and seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 1:
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def figures(results: Sequence[StormResult]) -> dict[str, Any]:
    """The benchmark's JSON figures: per-storm counts summed, requests per storm, throughput over all."""
    wall = sum(r.wall_seconds for r in results)
    total = sum(r.requests for r in results)

    def summed(name: str) -> int:
        return sum(int(getattr(r, name)) for r in results)

    return {
        "requests": results[0].requests if results else 0,
        "concurrency": results[0].concurrency if results else 0,
        "modes": sorted({r.mode for r in results}),
        "seeds": _seed_span(sorted({r.seed for r in results})),
        "storms": len(results),
        "leaked_blocks": summed("leaked_blocks"),
        "double_releases": summed("double_releases"),
        "premature_releases": summed("premature_releases"),
        "hung_requests": summed("hung_requests"),
        "integrity_failures": summed("integrity_failures"),
        "failed_reported_as_received": summed("failed_reported_as_received"),
        "corrupt_receives": summed("corrupt_receives"),
        "late_reads": summed("late_reads"),
        "late_reads_refused": summed("late_reads_refused"),
        "lease_renewals": summed("lease_renewals"),
        "lease_expiries": summed("lease_expiries"),
        "late_event_findings": sum(r.findings.get("late_event", 0) for r in results),
        "replay_matches": all(r.replay_matches for r in results),
        "forged_sent": summed("forged_sent"),
        "forged_messages_accepted": summed("forged_messages_accepted"),
        "hook_us_max": max((r.hook_us_max for r in results), default=0.0),
        "naive_leaked_blocks": summed("naive_leaked_blocks"),
        "naive_hung_requests": summed("naive_hung_requests"),
        "failed_storms": sum(1 for r in results if not r.ok),
        "wall_seconds": round(wall, 3),
        "sim_requests_per_s": round(total / wall, 1) if wall > 0 else 0.0,
    }
