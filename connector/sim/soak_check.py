"""After a soak: the storm's checks (check.py), plus what only a long run can break.

The merged log is replayed offline three times: with the replay's default compaction, with compaction
every `SOAK_REPLAY_COMPACT_EVERY` events, and with none. The first must take the releases the cores took
live; all three must take the same releases and leave the same findings. The peak of tracked sides must
stay within the config's bound. Re-asks must never load, a transfer id must never be accepted twice by
an engine that accepted it before (restarts included), and nothing per request may be left behind.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvledger.connector.sim.check import (
    PROBLEM_DETAILS_MAX,
    audit_config,
    judge_findings,
    mismatched_sources,
    problems,
    recorded,
    transport_view,
    vllm_view,
)
from kvledger.connector.sim.faults import NO_FAULTS
from kvledger.connector.sim.limits import SOAK_REPLAY_COMPACT_EVERY
from kvledger.connector.sim.soak import Soak, SoakTally
from kvledger.connector.sim.soak_config import SoakResult
from kvledger.ledger.audit import Finding, audit
from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import read_chunks, write_log
from kvledger.ledger.merge import batched, merge
from kvledger.ledger.replay import ReplayResult, replay_chunks


def evaluate_soak(soak: Soak, tally: SoakTally) -> SoakResult:
    cfg = soak.config
    r = SoakResult(seed=cfg.seed, mode=cfg.mode, requests=tally.issued, concurrency=cfg.concurrency)
    r.sim_seconds = round(tally.final_now + cfg.step_s - cfg.start_ts, 6)
    r.sim_hours = round(r.sim_seconds / 3600.0, 4)
    r.stepped_seconds, r.jumps, r.bursts = round(tally.stepped_seconds, 3), tally.jumps, tally.bursts
    streams, live = recorded(soak, tally, r)

    merged: list[Event] = list(merge(streams.values(), names=list(streams)))
    chunks: Iterable[list[Event]] = list(batched(merged))
    if cfg.incident_log is not None:
        write_log(cfg.incident_log, merged)
        r.incident_log = str(cfg.incident_log)
        chunks = list(read_chunks(cfg.incident_log))
    replays = {
        "default": replay_chunks(chunks),
        "often": replay_chunks(chunks, compact_every=SOAK_REPLAY_COMPACT_EVERY),
        "never": replay_chunks(chunks, compact_every=None),
    }
    default = replays["default"]
    mismatched = mismatched_sources(live, default.releases)
    r.replay_matches = not mismatched
    findings = {name: audit(replay.state, tally.final_now, audit_config(cfg)) for name, replay in replays.items()}
    r.compaction_invariant = _same(replays, findings)
    r.replay_compacted_sides = sum(default.state.compacted_by_phase.values())

    reused = {q.transfer_id for q in soak.requests if q.reuse_of is not None}
    faulted = {q.transfer_id for q in soak.requests if q.faults is not NO_FAULTS} | tally.death_touched | reused
    expected = {("id_reuse", tid) for tid in reused} | {("forged_message", tid) for tid in tally.forged}
    judge_findings(soak, findings["default"], faulted, expected, r)
    vllm_view(soak, tally, r)
    transport_view(soak, tally, r)
    r.unserved_requests = sum(1 for q in soak.requests if not (q.producer.needed or q.consumer.needed))
    _soak_figures(soak, tally, r)
    r.problems.extend(problems(soak, tally, r, mismatched))
    r.problems.extend(_soak_problems(soak, tally, r))
    return r


def _same(replays: dict[str, ReplayResult], findings: dict[str, list[Finding]]) -> bool:
    """The same releases in the same order, and the same findings (as a multiset), in every replay."""
    encoded = {name: sorted(msgspec.json.encode(f) for f in found) for name, found in findings.items()}
    first = next(iter(replays))
    return all(
        replays[name].releases == replays[first].releases and encoded[name] == encoded[first] for name in replays
    )


def _soak_figures(soak: Soak, tally: SoakTally, r: SoakResult) -> None:
    cfg = soak.config
    r.reasks, r.recomputes, r.local_computes = tally.reasks, tally.recomputes, tally.local_computes
    r.loaded_twice = len(tally.loaded_twice)
    r.second_alloc_claims = len(tally.second_alloc_claims)
    r.id_reuses = tally.id_reuses
    r.id_reuses_refused = dict(sorted(tally.refused.items()))
    r.id_reuse_answers = dict(sorted(tally.answers.items()))
    r.reuses_across_restart = tally.across_restart
    r.reuses_wrongly_accepted = list(tally.wrongly_accepted)
    r.unmapped_ids_refused = list(tally.unmapped_refused)
    r.restarts = dict(sorted(tally.restarts.items()))
    evicted = dict(tally.evicted_before_restart)
    for engine in soak.engines:
        for ledger in engine.ledgers:
            evicted[ledger.source] = evicted.get(ledger.source, 0) + ledger.state.tombstones_evicted
    r.tombstones_evicted = dict(sorted(evicted.items()))
    r.tombstone_generations = sum(evicted.values()) // max(1, cfg.tombstones_max // 2)
    r.peak_tracked_sides = tally.peak_total
    r.peak_tracked_sides_per_ledger = dict(sorted(tally.peak_per_ledger.items()))
    r.tracked_sides_bound = cfg.tracked_sides_bound
    r.tracked_sides_bound_per_ledger = cfg.tracked_sides_bound_per_ledger
    r.refold_tracked_sides = tally.refold_max
    left: list[str] = []
    for engine in soak.engines:
        scheduler, worker = engine.scheduler, engine.worker
        for name, size in (
            (f"{scheduler.source} request index", len(scheduler.index)),
            (f"{worker.source} request index", len(worker.index)),
            (f"{worker.source} in-flight transfers", len(worker.inflight)),
            (f"{worker.source} peers", len(worker.peers)),
        ):
            if size:
                left.append(f"{name}: {size}")
    r.bookkeeping_left = left


def _soak_problems(soak: Soak, tally: SoakTally, r: SoakResult) -> list[str]:
    out: list[str] = []
    for what, items in (
        ("requests that loaded twice", tally.loaded_twice),
        ("re-asks that loaded remote KV", tally.reask_loads),
        ("update_state_after_alloc after a load claimed it again", tally.second_alloc_claims),
        ("consumer request_finished kept blocks or returned params", tally.consumer_finish_kept),
        ("a transfer id accepted again by an engine that had accepted it", tally.wrongly_accepted),
        ("a transfer id refused by an engine that never accepted it", tally.unmapped_refused),
    ):
        if items:
            more = f" (+{len(items) - PROBLEM_DETAILS_MAX} more)" if len(items) > PROBLEM_DETAILS_MAX else ""
            out.append(f"{what}: {', '.join(items[:PROBLEM_DETAILS_MAX])}{more}")
    if not r.compaction_invariant:
        out.append("the offline replay's releases or findings change with compaction")
    cfg = soak.config
    if r.peak_tracked_sides > cfg.tracked_sides_bound:
        out.append(f"peak tracked sides {r.peak_tracked_sides} > bound {cfg.tracked_sides_bound}")
    over = {s: n for s, n in r.peak_tracked_sides_per_ledger.items() if n > cfg.tracked_sides_bound_per_ledger}
    if over:
        out.append(f"ledgers over their bound of {cfg.tracked_sides_bound_per_ledger} tracked sides: {over}")
    if r.bookkeeping_left:
        out.append(f"per-request state left at the end: {'; '.join(r.bookkeeping_left)}")
    return out
