"""The service's settings and named limits, read from arguments or `KVLEDGER_*` environment variables."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledger.limits import DEFAULT_CLOCK_SKEW_S, DEFAULT_DEFER_TIMEOUT_S, DEFAULT_TRANSFER_TIMEOUT_S


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
    replays_at_once_max: int = Field(default=2, ge=1, description="Replays folded concurrently; more get 429")
    page_limit_max: int = Field(default=1000, ge=1, description="Largest page of transfers, findings or events")
    timeline_events_max: int = Field(default=10_000, ge=1, description="Events shown in one transfer's timeline")
    stream_duration_max_s: float = Field(default=600, gt=0, description="A live event stream ends after this long")
    audit_cache_resolution_s: float = Field(
        default=1.0, ge=0, description="GET /audit without ?now= audits at the clock rounded down to this"
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

    @field_validator("token")
    @classmethod
    def _empty_token_is_none(cls, token: SecretStr | None) -> SecretStr | None:
        # An empty KVLEDGER_TOKEN (compose's default) means ingest is off, never "the empty token".
        return token if token is not None and token.get_secret_value() else None
