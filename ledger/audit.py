"""Audits: findings about a folded state at a given `now`, read from the fold's indexes.

Nothing here refolds the log: leaks come from the deadline heap, double owners
from the block index, anomalies from the per-transfer evidence the fold kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

import msgspec

from kvledger.ledger.events import ReqId, TransferId
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.humanize import duration, utc
from kvledger.ledger.limits import DEFAULT_CLOCK_SKEW_S, DEFAULT_TRANSFER_TIMEOUT_S
from kvledger.ledger.side import TransferState

Severity: TypeAlias = Literal["error", "warning", "info"]
SEVERITY_RANK: dict[str, int] = {"error": 0, "warning": 1, "info": 2}

CODES: dict[str, Severity] = {
    "leak": "error",
    "double_owner": "error",
    "premature_release": "error",
    "id_reuse": "error",
    "forged_message": "error",
    "stuck": "warning",
    "orphan_ack": "warning",
    "late_event": "warning",
    "over_ack": "warning",
    "duplicate": "info",
}
"""Every finding code and its severity (the CLI's exit status keys on severity)."""


class Finding(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One finding. Strings and tuples of ints only, so never part of a reference cycle: `gc=False` keeps
    100k findings out of the garbage collector's full passes (they stalled a service for seconds)."""

    code: str
    severity: Severity
    source: str
    transfer_id: TransferId
    request_id: ReqId | None
    block_ids: tuple[int, ...]
    evidence: tuple[int, ...]
    """Seqs (in `source`'s log, or as named in `detail`) of the events that show it."""
    detail: str


@dataclass(frozen=True)
class AuditConfig:
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    clock_skew_s: float = DEFAULT_CLOCK_SKEW_S

    def __post_init__(self) -> None:
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.clock_skew_s < 0:
            raise ValueError(f"clock_skew_s must be >= 0, got {self.clock_skew_s}")


def _finding(code: str, t: TransferState, evidence: tuple[int, ...], detail: str) -> Finding:
    return finding_of(code, t.source, t.transfer_id, t.request_id, t.block_ids, evidence, detail)


def finding_of(
    code: str,
    source: str,
    transfer_id: TransferId,
    request_id: ReqId | None,
    block_ids: tuple[int, ...],
    evidence: tuple[int, ...],
    detail: str,
) -> Finding:
    """A finding of `code` (its severity from `CODES`) about one side."""
    return Finding(
        code=code,
        severity=CODES[code],
        source=source,
        transfer_id=transfer_id,
        request_id=request_id,
        block_ids=block_ids,
        evidence=evidence,
        detail=detail,
    )


def finding_order(f: Finding) -> tuple[object, ...]:
    """The audit's order, total: worst first (severity, then oldest evidence), then by what the finding
    names. Total, so that findings gathered from partitions of a log (kvledger.ledger.partitioned) sort into exactly
    one fold's order; a tie left to the fold's dicts would follow the order events were folded in."""
    return (SEVERITY_RANK[f.severity], f.evidence[0] if f.evidence else 0, f.code, f.source, f.transfer_id,
            f.evidence, f.detail, f.request_id or "", f.block_ids)  # fmt: skip


def audit(state: LedgerState, now: float, config: AuditConfig | None = None) -> list[Finding]:
    """Every finding at time `now`, in `finding_order` (worst first: severity, then oldest evidence)."""
    cfg = config or AuditConfig()
    findings: list[Finding] = []
    leaked: set[tuple[str, str]] = set()
    for t in state.due(now):
        leaked.add((t.source, t.transfer_id))
        assert t.deadline is not None
        findings.append(
            _finding(
                "leak",
                t,
                (t.map_seq,),
                f"{_count(len(t.block_ids), 'block')} held {duration(now - t.deadline)} past the deadline, no decision",
            )
        )
    cutoff = now - cfg.transfer_timeout_s
    for key, t in state.live.items():
        if t.last_ts < cutoff and key not in leaked:
            findings.append(
                _finding(
                    "stuck",
                    t,
                    (t.map_seq, t.last_seq),
                    f"no event for {duration(now - t.last_ts)} (over the transfer timeout, "
                    f"{duration(cfg.transfer_timeout_s)}) in phase {t.phase}",
                )
            )
    for t in state.orphans_due(now, cfg.transfer_timeout_s):
        findings.append(_orphan(t, now, expired=False))
    for key in state.orphans_expired:
        findings.append(_orphan(state.transfers[key], now, expired=True))
    for key, claims in state.double_owned.items():
        t = state.transfers[key]
        if not t.live:
            continue
        for block, other_key, map_seq in claims:
            other = state.transfers.get(other_key)
            if other is not None and other.live:
                findings.append(
                    _finding(
                        "double_owner",
                        t,
                        (other.map_seq, map_seq),
                        f"block {block} also held by live transfer {other.transfer_id}",
                    )
                )
    for key in state.anomalous:
        findings.extend(_anomalies(state.transfers[key]))
    findings.extend(past_window(state))
    findings.extend(premature_releases(state, cfg.clock_skew_s))
    findings.extend(forged_messages(state))
    findings.sort(key=finding_order)
    return findings


def _orphan(t: TransferState, now: float, *, expired: bool) -> Finding:
    what = "expired before any map" if expired else f"unmapped for {duration(now - t.first_ts)}"
    return _finding(
        "orphan_ack", t, (t.first_seq, t.last_seq), f"{_events(t.events)} for a transfer never mapped: {what}"
    )


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _events(count: int) -> str:
    return _count(count, "event")


def _anomalies(t: TransferState) -> list[Finding]:
    out: list[Finding] = []
    if t.late_seqs:
        cause = t.decision.cause if t.decision else "expired"
        hint = "; an ack after an expire means the timeout is too short" if cause == "expired" else ""
        out.append(
            _finding(
                "late_event",
                t,
                tuple(t.late_seqs),
                f"{_events(len(t.late_seqs))} after the {cause} decision{hint}",
            )
        )
    if t.over_ack_seqs:
        out.append(
            _finding(
                "over_ack",
                t,
                tuple(t.over_ack_seqs),
                f"acks beyond what was scheduled or sealed (expected {t.expected}, acked {t.acked_mask.bit_count()})",
            )
        )
    if t.reuse_seqs:
        held = "holds it" if t.live else f"held it (released: {t.phase})"
        by = ", ".join(t.reused_by or ())
        out.append(
            _finding(
                "id_reuse",
                t,
                (t.map_seq, *t.reuse_seqs),
                f"transfer id mapped again by request {by} while {t.request_id} {held}: refused",
            )
        )
    if t.duplicate_seqs:
        out.append(_finding("duplicate", t, tuple(t.duplicate_seqs), "duplicate ack, schedule, seal or map"))
    return out


def past_window(state: LedgerState) -> list[Finding]:
    """Rule S's findings (ledger/upkeep.py): events of a stamped id past its window, each judged alone. A map
    is a refused reuse of the id (`id_reuse`), anything else is late (`late_event`)."""
    out: list[Finding] = []
    for r in state.past_window.values():
        if r.maps:
            out.append(
                Finding(
                    code="id_reuse", severity=CODES["id_reuse"], source=r.source, transfer_id=r.transfer_id,
                    request_id=r.request_id, block_ids=r.block_ids, evidence=tuple(r.map_seqs),
                    detail=f"transfer id mapped {_count(r.maps, 'time')} after its id window ended "
                    f"({utc(r.window_end)}): refused",
                )
            )  # fmt: skip
        if r.late:
            out.append(
                Finding(
                    code="late_event", severity=CODES["late_event"], source=r.source, transfer_id=r.transfer_id,
                    request_id=None, block_ids=(), evidence=tuple(r.late_seqs),
                    detail=f"{_events(r.late)} after the transfer id's window ended ({utc(r.window_end)}): "
                    "judged alone",
                )
            )  # fmt: skip
    return out


def forged_messages(state: LedgerState) -> list[Finding]:
    """A peer's control message dropped as unproven: someone who can reach a notify or handshake port
    spoke without the key (or from an unlisted host). The latest ones, with their `drop` events."""
    return [
        Finding(
            code="forged_message",
            severity=CODES["forged_message"],
            source=e.source,
            transfer_id=e.transfer_id,
            request_id=None,
            block_ids=(),
            evidence=(e.seq,),
            detail=f"{e.message} from {e.sender} dropped ({e.reason}); nothing acted on it",
        )
        for e in state.forged_recent
    ]


def premature_releases(state: LedgerState, clock_skew_s: float) -> list[Finding]:
    """Producers released by expire while the consumer's read of the same transfer finished later.

    Needs both sides in one state (a merged fold). Compares wall-clock `ts` of
    two machines, so only gaps beyond `clock_skew_s` count.
    """
    out: list[Finding] = []
    for key in state.expired_producers:
        producer = state.side(key)  # whole, or rebuilt from its tombstone: compaction changes nothing here
        if producer is None or producer.decision is None:
            continue  # retired by its id window (ledger/upkeep.py) and not a premature pair
        released_ts = producer.decision.ts
        for source in state.sources:
            consumer = state.side((source, producer.transfer_id))
            if consumer is None or consumer.role != "consumer" or consumer.arrived_ts is None:
                continue
            if consumer.arrived_ts > released_ts + clock_skew_s:
                out.append(
                    _finding(
                        "premature_release",
                        producer,
                        (producer.decision.seq, consumer.arrived_seq),
                        f"released by expire at {utc(released_ts, digits=6)}; consumer {source} finished reading "
                        f"{duration(consumer.arrived_ts - released_ts)} later (seq {consumer.arrived_seq} there)",
                    )
                )
    return out


def counts_by_code(findings: list[Finding]) -> dict[str, int]:
    out = dict.fromkeys(CODES, 0)
    for f in findings:
        out[f.code] += 1
    return out


def found_at(f: Finding, state: LedgerState, config: AuditConfig | None = None) -> float:
    """When a finding became true, in log time: a leak at its deadline, stuck or orphan when the transfer
    timeout ran out, anything else at its side's last event (the evidence was complete by then)."""
    key = (f.source, f.transfer_id)
    record = state.past_window.get(key)
    if record is not None and f.evidence in (tuple(record.map_seqs), tuple(record.late_seqs)):
        return record.last_ts  # a rule S finding (`past_window`): the side, held or retired, is not read
    t = state.side(key)
    if t is None:
        return 0.0  # retired by its id window: no time left to tell
    timeout_s = (config or AuditConfig()).transfer_timeout_s
    if f.code == "leak" and t.deadline is not None:
        return t.deadline
    if f.code == "stuck":
        return t.last_ts + timeout_s
    if f.code == "orphan_ack" and t.role is None:
        return t.first_ts + timeout_s
    return t.last_ts
