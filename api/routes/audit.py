"""Audit findings at a given `now` and the summary an SRE reads first (counts, holdings, latency, advice)."""

from __future__ import annotations

from typing import Annotated, Literal, Protocol, get_args

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from kvledger.api.deps import LiveDep
from kvledger.api.params import Now, check_limit
from kvledger.api.schemas import AuditOut, AuditSummary, OldestHeld
from kvledger.api.views import finding_out
from kvledger.ledger.advice import LatencyRecorder, late_after_expire, percentiles, verdict
from kvledger.ledger.audit import CODES, Finding, counts_by_code
from kvledger.ledger.side import TransferState
from kvledger.ledger.sources import SourceHealth, oldest_on_live_source

router = APIRouter(tags=["audit"])

FindingCode = Literal[
    "leak", "double_owner", "premature_release", "id_reuse", "forged_message", "stuck", "orphan_ack", "late_event",
    "over_ack", "duplicate",
]  # fmt: skip
assert set(get_args(FindingCode)) == set(CODES), "FindingCode must list kvledger.ledger.audit.CODES"


@router.get("/audit", response_model=AuditOut, summary="Findings at `now`, worst first, with evidence seqs")
async def get_audit(
    request: Request,
    live: LiveDep,
    now: Now = None,
    code: Annotated[FindingCode | None, Query(description="Only findings with this code")] = None,
    limit: Annotated[int, Query(ge=1, le=1 << 30)] = 100,
) -> AuditOut | Response:
    check_limit(live, limit)
    if now is None:  # the published audit: read, never computed here (kvledger.api.live)
        audited = live.published()
        answers: PublishedAnswers = request.app.state.published_answers
        return answers.answer(audited, code, limit)
    findings = live.findings(now)
    return audit_out(now, findings, counts_by_code(findings), code, limit)


PUBLISHED_ANSWERS_KEPT = 64
"""Queries of the published audit whose `GET /audit` answers are kept (`PublishedAnswers`), at most."""


class Published(Protocol):
    """What `GET /audit` reads of a published audit (the one-process service's `Audited`, the fleet's)."""

    @property
    def now(self) -> float: ...
    @property
    def findings(self) -> list[Finding]: ...
    @property
    def counts(self) -> dict[str, int]: ...


class PublishedAnswers:
    """`GET /audit`'s answers to the published audit, each serialized once. Pollers ask the same query of it
    again and again (a dashboard, a probe every few tens of milliseconds), and each answer cost a
    serialization of up to `limit` findings, the largest share of a request's time and of the service's CPU
    under such polling. Exact: an answer is a function of the published audit, which is replaced whole and
    never changed, and of the query; kept for the newest published audit only (another one, by identity,
    drops them all), PUBLISHED_ANSWERS_KEPT queries at most (the rest answered as without it)."""

    def __init__(self) -> None:
        self._of: object | None = None
        self._bodies: dict[tuple[str | None, int], bytes] = {}

    def answer(self, published: Published, code: str | None, limit: int) -> Response:
        """The answer to (`code`, `limit`) of `published`."""
        if published is not self._of:
            self._of, self._bodies = published, {}
        key = (code, limit)
        body = self._bodies.get(key)
        if body is None:
            body = audit_json(audit_out(published.now, published.findings, published.counts, code, limit))
            if len(self._bodies) < PUBLISHED_ANSWERS_KEPT:
                self._bodies[key] = body
        return Response(body, media_type="application/json")


def audit_json(out: AuditOut) -> bytes:
    """`out` as FastAPI serializes a route's `response_model` answer (JSON-mode dump by alias, compact JSON)."""
    return bytes(JSONResponse(out.model_dump(mode="json", by_alias=True)).body)


def audit_out(at: float, findings: list[Finding], counts: dict[str, int], code: str | None, limit: int) -> AuditOut:
    """`GET /audit`'s answer from an audit at `at` (the one-process service's, or partition workers' merged)."""
    chosen = findings if code is None else [f for f in findings if f.code == code]
    return AuditOut(
        now=at,
        total=len(chosen),
        counts=counts,
        findings=[finding_out(f) for f in chosen[:limit]],
        truncated=len(chosen) > limit,
    )


def oldest_held(t: TransferState | None, now: float) -> OldestHeld | None:
    """The oldest side held on a live source (`kvledger.ledger.sources.oldest_on_live_source`), as the summary
    says it."""
    if t is None:
        return None
    return OldestHeld(
        source=t.source,
        transfer_id=t.transfer_id,
        request_id=t.request_id,
        first_ts=t.first_ts,
        age_s=max(0.0, now - t.first_ts),
        blocks=len(t.block_ids),
    )


def summary_of(
    at: float,
    findings: list[Finding],
    health: dict[str, SourceHealth],
    *,
    live_transfers: int,
    blocks_held: int,
    oldest: TransferState | None,
    releases_by_cause: dict[str, int],
    latency: LatencyRecorder,
    late_after_expire: int,
    defer_timeout_s: float,
) -> AuditSummary:
    """The summary of one fold's figures (the one-process service's, or partition workers' merged)."""
    lost = {h.source: h for h in health.values() if h.lost}
    completed = percentiles(latency.completed)
    return AuditSummary(
        now=at,
        counts=counts_by_code(findings),
        findings_total=len(findings),
        live_transfers=live_transfers,
        blocks_held=blocks_held,
        oldest_held=oldest_held(oldest, at),
        lost_sources={source: h.why for source, h in sorted(lost.items())},
        blocks_lost=sum(h.blocks_held for h in lost.values()),
        releases_by_cause=releases_by_cause,
        ack_latency_s=completed,
        release_latency_s=percentiles(latency.all_causes),
        defer_timeout_s=defer_timeout_s,
        timeout_advice=verdict(completed["p99"], defer_timeout_s, late_after_expire),
    )


@router.get("/audit/summary", response_model=AuditSummary, summary="Counts, holdings, latencies, timeout advice")
async def get_summary(live: LiveDep, now: Now = None) -> AuditSummary:
    at, findings = live.findings_at(now)
    state = live.state
    health = live.health(at)
    return summary_of(
        at,
        findings,
        health,
        live_transfers=len(state.live),
        blocks_held=state.blocks_held,
        oldest=oldest_on_live_source(state.live.values(), health),
        releases_by_cause={str(k): v for k, v in state.releases_by_cause.items()},
        latency=live.latency,
        late_after_expire=late_after_expire(state, findings),
        defer_timeout_s=live.settings.defer_timeout_s,
    )
