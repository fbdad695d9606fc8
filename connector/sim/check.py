"""After a storm: merge the four logs, replay them offline, audit them, run the naive baseline, judge.

Every invariant that fails becomes one line in `StormResult.problems`, so a
failing seed says what broke; `ok` is "no problems".
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

import msgspec

from kvledger.connector.sim.config import StormConfig, StormResult
from kvledger.connector.sim.driver import Storm
from kvledger.connector.sim.faults import NO_FAULTS
from kvledger.connector.sim.naive import run_naive
from kvledger.connector.sim.tally import Tally
from kvledger.ledger.audit import AuditConfig, Finding, audit, counts_by_code
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Drop, Event, Map, TransferId, to_json
from kvledger.ledger.fold import fold_all
from kvledger.ledger.jsonl import read_events, write_log
from kvledger.ledger.merge import merge

LATE_CHECKED_MESSAGES = ("release", "write_done", "write_failed")
"""Messages that become events where they land; a late remote_blocks is not an event (the producer only
notes where to write), so its lateness shows only through the consumer's later expiry."""

PROBLEM_DETAILS_MAX = 10
"""Transfer ids named per problem line."""


def fingerprint(streams: dict[str, list[Event]]) -> str:
    """A digest of each transfer side's events in order, seqs and peer addresses left out: the run's decisions
    and evidence, independent of the ports the kernel chose and of how one batch's events of different
    transfers interleave (a core folds some reports in set order, which changes between processes)."""
    per_key: dict[tuple[str, str], list[bytes]] = {}
    for events in streams.values():
        for e in events:
            bare = (
                msgspec.structs.replace(e, seq=0, peer=None)
                if isinstance(e, Map)
                else msgspec.structs.replace(e, seq=0)
            )
            per_key.setdefault((e.source, e.transfer_id), []).append(to_json(bare))
    digest = hashlib.sha256()
    for key in sorted(per_key):
        digest.update(repr(key).encode())
        for line in per_key[key]:
            digest.update(line)
    return digest.hexdigest()[:16]


def _names(tids: Iterable[str]) -> str:
    items = sorted(tids)
    more = f" (+{len(items) - PROBLEM_DETAILS_MAX} more)" if len(items) > PROBLEM_DETAILS_MAX else ""
    return ", ".join(items[:PROBLEM_DETAILS_MAX]) + more


def evaluate(storm: Storm, tally: Tally) -> StormResult:
    cfg: StormConfig = storm.config
    r = StormResult(seed=cfg.seed, mode=cfg.mode, requests=cfg.requests, concurrency=cfg.concurrency)
    r.unserved_requests = cfg.requests - tally.issued
    r.dead_engine = tally.dead
    r.sim_seconds = round(tally.rounds * cfg.step_s, 6)
    streams, live = recorded(storm, tally, r)

    # The merged incident log, replayed offline: the same releases per source, in the same order.
    merged: Iterable[Event] = list(merge(streams.values(), names=list(streams)))
    if cfg.incident_log is not None:
        write_log(cfg.incident_log, merged)
        r.incident_log = str(cfg.incident_log)
        merged = read_events(cfg.incident_log)
    state, releases = fold_all(merged)
    mismatched = mismatched_sources(live, releases)
    r.replay_matches = not mismatched

    counts = state.lease_counts
    r.late_reads_refused = counts.get("reads_refused", 0)
    r.lease_renewals, r.lease_expiries = counts.get("renewals", 0), counts.get("expiries", 0)
    r.late_reads = sum(1 for q in storm.requests if q.faults.late_reader_rounds and q.consumer.admitted)
    findings = audit(state, tally.final_now, audit_config(cfg))
    faulted = {q.transfer_id for q in storm.requests if q.faults is not NO_FAULTS} | tally.death_touched
    judge_findings(storm, findings, faulted, {("forged_message", tid) for tid in tally.forged}, r)
    vllm_view(storm, tally, r)
    transport_view(storm, tally, r)

    engines = storm.engines
    lost = {(e.worker.source, q.transfer_id) for q in storm.requests for e, s in
            ((storm.producer, q.producer), (storm.consumer, q.consumer)) if s.lost}  # fmt: skip
    naive = run_naive({e.worker.source: e.events[e.worker.source] for e in engines}, lost)
    r.naive_leaked_blocks, r.naive_hung_requests = naive.leaked_blocks, naive.hung_requests
    r.naive_dropped_acks = naive.dropped_acks
    r.problems.extend(problems(storm, tally, r, mismatched))
    return r


def transport_view(storm: Storm, tally: Tally, r: StormResult) -> None:
    """The tcp transports' side of the run (silent_peer): requests sent to the silent peer, slots still held at
    the end, transfers starved."""
    r.silent_requests = sum(e.transport.silent_sent for e in (*storm.engines, *storm.retired))
    r.inflight_leaked = storm.inflight_leaked
    r.starved_transfers = len(starved(storm, tally))


def starved(storm: Storm, tally: Tally) -> list[TransferId]:
    """Transfers no fault touched (nor a death) that the tcp transport refused an in-flight slot and whose receive
    then failed: other requests held the slots."""
    refused = {tid for e in (*storm.engines, *storm.retired) for tid in e.transport.slots_refused}
    return [
        q.transfer_id
        for q in storm.requests
        if q.transfer_id in refused
        and q.faults is NO_FAULTS
        and q.transfer_id not in tally.death_touched
        and q.consumer.failed
    ]


def recorded(storm: Storm, tally: Tally, r: StormResult) -> tuple[dict[str, list[Event]], dict[str, list[Release]]]:
    """Every source's events and the releases its core took live (a restarted engine's continue its
    predecessor's); fills the run's size and fingerprint into `r`."""
    r.rounds, r.wall_seconds = tally.rounds, tally.wall_seconds
    streams: dict[str, list[Event]] = {source: ev for e in storm.engines for source, ev in e.events.items()}
    live: dict[str, list[Release]] = {source: rel for e in storm.engines for source, rel in e.releases.items()}
    r.events = sum(len(v) for v in streams.values())
    r.fingerprint = fingerprint(streams)
    return streams, live


def mismatched_sources(live: dict[str, list[Release]], offline_releases: Iterable[Release]) -> list[str]:
    """The sources whose offline releases differ from those their core took live (in order)."""
    offline: dict[str, list[Release]] = {source: [] for source in live}
    for release in offline_releases:
        offline.setdefault(release.source, []).append(release)
    return [source for source in offline if offline[source] != live.get(source, [])]


def audit_config(cfg: StormConfig) -> AuditConfig:
    """Both engines share the simulated clock: no skew allowance."""
    return AuditConfig(transfer_timeout_s=cfg.transfer_timeout_s, clock_skew_s=0.0)


def judge_findings(
    storm: Storm,
    findings: list[Finding],
    faulted: set[TransferId],
    expected_errors: set[tuple[str, TransferId]],
    r: StormResult,
) -> None:
    """Findings by code, those on a dead engine, those no injected fault explains (a non-error finding on a
    transfer in `faulted`, or an error `(code, transfer)` in `expected_errors`, is explained), and late
    notifications without their late_event."""
    dead_sources = _dead_sources(storm)
    r.findings = {code: n for code, n in counts_by_code(findings).items() if n}
    r.findings_on_dead_engine = dict(Counter(f.code for f in findings if f.source in dead_sources))
    r.premature_releases = r.findings.get("premature_release", 0)
    r.unexplained_findings = [
        _describe(f) for f in findings if not _explained(f, faulted, expected_errors, dead_sources)
    ]
    late_sent: dict[TransferId, str] = {}
    for e in storm.engines:
        late_sent.update({tid: e.name for tid in e.channel.late_sent})
    late_tids = {f.transfer_id for f in findings if f.code == "late_event"}
    r.late_faults_unreported = sorted(
        tid for tid in late_sent if tid not in late_tids and _late_message(storm, tid) in LATE_CHECKED_MESSAGES
    )


def _dead_sources(storm: Storm) -> set[str]:
    """The sources of processes that died (a dead engine's, a restarted engine's earlier lives' when they wrote
    logs of their own), not those a live process continues (a restart that reopened its store)."""
    own = {e: {ledger.source for ledger in e.ledgers} for e in (*storm.engines, *storm.retired)}
    live = {source for e, sources in own.items() if e.alive for source in sources}
    return {source for e, sources in own.items() if not e.alive for source in sources} - live


def vllm_view(storm: Storm, tally: Tally, r: StormResult) -> None:
    """vLLM's side of the run, from the driver's block pools and reports."""
    engines = (*storm.engines, *storm.retired)
    sides = [(q, s) for q in storm.requests for s in (q.producer, q.consumer)]
    r.finished_sending = sum(1 for q in storm.requests if q.producer.reported)
    r.finished_recving = sum(1 for q in storm.requests if q.consumer.reported)
    r.failed_recving = sum(1 for q in storm.requests if q.consumer.failed)
    r.leaked_blocks = sum(e.pool.held for e in storm.engines if e.alive)
    r.double_releases = tally.double_reports + sum(e.pool.double_frees for e in engines)
    r.hung_requests = sum(1 for _, s in sides if s.hung)
    r.lost_requests = sum(1 for _, s in sides if s.lost)
    r.integrity_checked = tally.integrity_checked
    r.integrity_failures = len(tally.integrity_failures)
    r.failed_reported_as_received = len(tally.failed_reported_as_received)
    r.faults_injected = _faults_injected(storm, tally)
    r.hook_us_max = round(max(e.hook_s_max for e in engines) * 1e6, 1)
    r.stale_links = sum(e.worker.counters["links_stale"] for e in engines)
    r.forged_sent = len(tally.forged)
    producers = [e for e in engines if e.name == storm.producer.name]  # every life of the producer
    dropped = {
        e.transfer_id
        for worker_source in {p.worker.source for p in producers}
        for e in storm.producer.events.get(worker_source, [])
        if isinstance(e, Drop) and e.reason == "bad_mac"
    }
    # A producer that died before its next poll never recorded the drop (nor acted on anything).
    died = tally.dead == storm.producer.name or storm.producer.name in tally.restarted
    unseen = tally.death_touched if died else set()
    r.forged_messages_accepted = len(tally.forged - dropped - unseen)


def problems(storm: Storm, tally: Tally, r: StormResult, mismatched: list[str]) -> list[str]:
    """Each broken invariant of the run, in words."""
    out: list[str] = []
    if r.leaked_blocks:
        out.append(f"{r.leaked_blocks} blocks still allocated at the end")
    for e in storm.engines:
        if not e.alive:
            continue
        for ledger in e.ledgers:
            if ledger.state.live or ledger.state.blocks_held:
                out.append(
                    f"{ledger.source}: {len(ledger.state.live)} live transfers, {ledger.state.blocks_held} blocks held"
                )
    if r.double_releases:
        out.append(f"{r.double_releases} double releases")
    if tally.unknown_reports:
        out.append(f"reports naming requests vLLM does not hold (it asserts): {_names(tally.unknown_reports)}")
    if r.premature_releases:
        out.append(f"{r.premature_releases} premature releases")
    hung = [q.transfer_id for q in storm.requests for s in (q.producer, q.consumer) if s.hung]
    if hung:
        out.append(f"{len(hung)} request sides never finished: {_names(hung)}")
    if tally.integrity_failures:
        out.append(f"received bytes differ from the producer's: {_names(tally.integrity_failures)}")
    if tally.failed_reported_as_received:
        out.append(f"failed transfers reported as received: {_names(tally.failed_reported_as_received)}")
    if tally.load_errors_missing:
        out.append(f"failed receives without their load-error blocks: {_names(tally.load_errors_missing)}")
    if mismatched:
        out.append(f"offline replay decided differently for {', '.join(mismatched)}")
    if r.unexplained_findings:
        out.append(f"{len(r.unexplained_findings)} findings no injected fault explains")
    if r.forged_messages_accepted:
        out.append(f"{r.forged_messages_accepted} forged releases not dropped")
    if r.starved_transfers:
        out.append(f"transfers refused in-flight slots held for others, then failed: {_names(starved(storm, tally))}")
    if r.inflight_leaked:
        out.append(f"{r.inflight_leaked} tcp in-flight slots never came back")
    if r.late_faults_unreported:
        out.append(f"late notifications without a late_event finding: {_names(r.late_faults_unreported)}")
    if tally.horizon_reached:
        out.append("the run hit its horizon with requests unresolved")
    return out


def _explained(
    f: Finding, faulted: set[TransferId], expected_errors: set[tuple[str, TransferId]], dead_sources: set[str]
) -> bool:
    if f.source in dead_sources:
        return True  # whatever a dead engine held died with it
    if f.severity == "error":
        # A leak, double owner or premature release on a live engine: never expected; an id reuse only
        # where the run injected it.
        return (f.code, f.transfer_id) in expected_errors
    return f.transfer_id in faulted


def _describe(f: Finding) -> str:
    return f"{f.code} {f.source} {f.transfer_id}: {f.detail}"


def _late_message(storm: Storm, tid: TransferId) -> str:
    faults = storm.network.faults(tid)
    return next((m.target for m in faults.messages if m.kind == "late"), "")


def _faults_injected(storm: Storm, tally: Tally) -> dict[str, int]:
    planned: Counter[str] = Counter()
    for q in storm.requests:
        planned.update(q.faults.kinds())
    if tally.dead is not None:
        planned["peer_death"] = 1
    if tally.restarted:
        planned["peer_restart_layout"] = len(tally.restarted)
    return dict(sorted(planned.items()))
