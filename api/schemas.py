"""Pydantic response models: the service's public JSON, apart from the store's tables and the fold."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

EventJson = Annotated[dict[str, Any], WithJsonSchema({"allOf": [{"$ref": "#/components/schemas/Event"}]})]
"""One ledger event as JSON; its schema is generated from the ledger's msgspec structs (kvledger.api.event_schema)."""


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    ready: bool
    store: str = Field(description="The store URL, password removed")
    cursor: int = Field(
        description="Store-wide cursor of the last folded event (with partition workers: the least cursor every "
        "owned partition has folded through)"
    )
    error: str | None = None


class QuarantinedOut(BaseModel):
    id: int
    created_ts: float
    source: str
    seq: int | None = Field(description="None when the event's seq is not a 64-bit integer")
    reason: str = Field(description="Why the store refused it")
    event: str = Field(description="The event as one JSON line, as it was")


class QuarantineOut(BaseModel):
    total: int
    events: list[QuarantinedOut]


class EventRow(BaseModel):
    cursor: int = Field(description="Store-wide insertion order; pass as after_seq to continue")
    event: EventJson


class EventPage(BaseModel):
    events: list[EventRow]
    next_after_seq: int


class Gap(BaseModel):
    source: str
    missing_from: int
    missing_to: int


class IngestResult(BaseModel):
    received: int
    inserted: int
    duplicates: int = Field(description="Events already stored with the same content (idempotent retries)")
    gaps: list[Gap] = Field(description="Seqs missing before this batch's events, per source")
    cursor: int = Field(
        description="The service's folded cursor after this batch (with partition workers, which fold it later: "
        "the store's cursor of its last event, folded once GET /readyz's cursor reaches it)"
    )


class ReleaseOut(BaseModel):
    source: str
    transfer_id: str
    request_id: str
    role: str
    mode: str
    block_ids: list[int]
    cause: str
    seq: int
    ts: float
    reason: str = ""


class TransferOut(BaseModel):
    """One side of a transfer as the ledger's fold derived it (`TransferState.snapshot()`)."""

    model_config = ConfigDict(extra="ignore")

    source: str
    transfer_id: str
    phase: str
    live: bool
    role: str | None
    mode: str | None
    request_id: str | None
    block_ids: list[int]
    remote_block_ids: list[int] | None
    peer: str | None
    acks_expected: int
    deadline: float | None
    expected: int | None
    scheduled: list[int] | None
    acked: list[int] | None
    release_ranks: list[int] | None
    recv: bool
    transient_failures: int
    retries: int
    deferrals: int
    first_ts: float
    last_ts: float
    first_seq: int
    last_seq: int
    events: int
    decision: ReleaseOut | None
    late_seqs: list[int] | None
    duplicate_seqs: list[int] | None
    over_ack_seqs: list[int] | None
    reuse_seqs: list[int] | None


class TransferPage(BaseModel):
    transfers: list[TransferOut]
    next_cursor: int | None = Field(description="Pass as ?cursor= for the next page; null at the end")


class FindingOut(BaseModel):
    code: str
    severity: str
    source: str
    transfer_id: str
    request_id: str | None
    block_ids: list[int]
    evidence: list[int] = Field(description="Seqs of the events that show it (in `source`'s log)")
    detail: str


class TransferDetail(BaseModel):
    transfer_id: str
    sides: list[TransferOut] = Field(description="Every source's side of this transfer id")
    findings: list[FindingOut]
    timeline: list[EventJson] = Field(description="All sides' events in store order")
    timeline_truncated: bool


class RequestDetail(BaseModel):
    request_id: str
    sides: list[TransferOut]


class AuditOut(BaseModel):
    now: float
    total: int
    counts: dict[str, int]
    findings: list[FindingOut]
    truncated: bool


class OldestHeld(BaseModel):
    source: str
    transfer_id: str
    request_id: str | None
    first_ts: float
    age_s: float
    blocks: int


class AuditSummary(BaseModel):
    now: float
    counts: dict[str, int]
    findings_total: int
    live_transfers: int
    blocks_held: int
    """Every live side's blocks, lost engines' included (what the fold holds)."""
    oldest_held: OldestHeld | None = Field(description="The oldest side held on an engine not lost")
    lost_sources: dict[str, str] = Field(
        description="Sources lost (silent while holding blocks, or known dead), with why: what they held is gone "
        "with the engine, not leaked"
    )
    blocks_lost: int = Field(description="Blocks held by lost sources (part of blocks_held)")
    releases_by_cause: dict[str, int]
    ack_latency_s: dict[str, float | None] = Field(
        description="Completed-release latency (p50, p90, p99): first event to the ack, completed releases only; "
        "the figure timeout_advice names"
    )
    release_latency_s: dict[str, float | None] = Field(
        description="Release latency of all causes (p50, p90, p99): first event to the release, expired and "
        "failed releases included, so its tail reaches the timeouts"
    )
    defer_timeout_s: float
    timeout_advice: str = Field(
        description="One sentence on defer_timeout, from the p99 completed-release latency (ack_latency_s)"
    )


class ReplayOut(BaseModel):
    events: int
    sources: list[str]
    transfers: int
    phases: dict[str, int]
    live_transfers: int
    blocks_held: int
    releases_by_cause: dict[str, int]
    decisions: list[ReleaseOut]
    decisions_total: int
    now: float = Field(description="The audit time: until_ts, else the last event's ts")
    counts: dict[str, int]
    findings: list[FindingOut]
    findings_total: int
