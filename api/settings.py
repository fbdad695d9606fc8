"""The service's settings and named limits, read from arguments or `KVLEDGER_*` environment variables."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvledger.ledger.audit import AuditConfig
from kvledger.ledger.limits import DEFAULT_CLOCK_SKEW_S, DEFAULT_DEFER_TIMEOUT_S, DEFAULT_TRANSFER_TIMEOUT_S


class Settings(BaseSettings):
    """Everything `create_app` needs; every queue, page and body has a limit here."""

    model_config = SettingsConfigDict(env_prefix="KVLEDGER_", extra="forbid")

    db: str = Field(
        default="sqlite:///kvledger.db", description="Store URL (sqlite:///path or postgresql+psycopg://...)"
    )
    token: SecretStr | None = Field(default=None, description="Bearer token for POST /events; unset disables ingest")
    poll_interval_s: float = Field(default=0.5, gt=0, le=60, description="How often the store's tail is polled")
    tail_batch_max: int = Field(default=1000, ge=1, le=10_000, description="Events folded per store read")
    ingest_events_max: int = Field(default=10_000, ge=1, description="Events in one POST /events batch")
    ingest_body_bytes_max: int = Field(default=16 << 20, ge=1024, description="Bytes in one POST /events body")
    replay_body_bytes_max: int = Field(default=256 << 20, ge=1024, description="Bytes in one uploaded incident log")
    replays_at_once_max: int = Field(
        default=2, ge=1, description="Replays folded at once, a slot taken once the upload is read; more get 429"
    )
    replay_uploads_at_once_max: int = Field(
        default=8, ge=1, description="Replay uploads being read at once (each a temporary file); more get 429"
    )
    page_limit_max: int = Field(default=1000, ge=1, description="Largest page of transfers, findings or events")
    timeline_events_max: int = Field(default=10_000, ge=1, description="Events shown in one transfer's timeline")
    stream_duration_max_s: float = Field(default=600, gt=0, description="A live event stream ends after this long")
    audit_cache_resolution_s: float = Field(
        default=1.0, ge=0, description="GET /audit without ?now= audits at the clock rounded down to this"
    )
    header_timeout_s: float = Field(
        default=10,
        gt=0,
        description="A request's header must be complete this long after the connection or the "
        "previous response; then the connection is closed",
    )
    body_timeout_s: float = Field(
        default=60, gt=0, description="A request's whole body must arrive within this long; then 408 and close"
    )
    keep_alive_s: float = Field(default=5, gt=0, description="An idle kept-alive connection is closed after this")
    header_bytes_max: int = Field(
        default=64 << 10, ge=4096, description="Bytes of request line and headers; more get 400 and a close"
    )
    connections_max: int = Field(
        default=256, ge=1, description="Open connections (and requests in progress); beyond, new requests get 503"
    )
    store_threads_max: int = Field(
        default=8,
        ge=1,
        description="Threads the store's calls may take at once: a stalled store never takes "
        "the threads other endpoints need",
    )
    ready_timeout_s: float = Field(
        default=2, gt=0, description="GET /readyz says not ready when the store does not answer within this"
    )
    snapshot_every_events: int = Field(
        default=100_000, ge=0, description="A snapshot of the fold is written in the background after this many "
        "events folded since the last (a start folds only what follows the newest); 0: never written",
    )  # fmt: skip
    snapshot_interval_s: float = Field(
        default=600, gt=0, description="... or this long after the last, when any event was folded since"
    )
    snapshots_read: bool = Field(
        default=True, description="Start from the newest usable snapshot; false folds the whole store at start"
    )
    transfer_timeout_s: float = Field(default=DEFAULT_TRANSFER_TIMEOUT_S, gt=0)
    defer_timeout_s: float = Field(default=DEFAULT_DEFER_TIMEOUT_S, gt=0)
    clock_skew_s: float = Field(default=DEFAULT_CLOCK_SKEW_S, ge=0)
    dead_engines: dict[str, str] = Field(
        default_factory=dict,
        description="Engines (or single sources) known dead, with why: what they hold is shown as lost, not leaked",
    )
    behind_after_s: float = Field(
        default=10.0, ge=0, description="The page says the service is behind when the store holds events the fold "
        "has not read and it last caught up longer ago than this",
    )  # fmt: skip

    def audit_config(self) -> AuditConfig:
        """What the service audits with: the one-process fold's, the partition workers' merge and a replay's."""
        return AuditConfig(self.transfer_timeout_s, self.clock_skew_s)

    @field_validator("token")
    @classmethod
    def _empty_token_is_none(cls, token: SecretStr | None) -> SecretStr | None:
        # An empty KVLEDGER_TOKEN (compose's default) means ingest is off, never "the empty token".
        return token if token is not None and token.get_secret_value() else None
