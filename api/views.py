"""Conversions from the ledger's objects (fold state, findings, releases) to the response models."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from kvledger.api.schemas import FindingOut, ReleaseOut, TransferOut
from kvledger.ledger.audit import Finding
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Event
from kvledger.ledger.side import TransferState
from kvledger.ledger.store.base import StoreError
from kvledger.ledger.store.url import parse_url


def transfer_out(t: TransferState) -> TransferOut:
    return TransferOut.model_validate(t.snapshot() | {"live": t.live})


def finding_out(f: Finding) -> FindingOut:
    return FindingOut.model_validate(msgspec.structs.asdict(f))


def release_out(r: Release) -> ReleaseOut:
    return ReleaseOut.model_validate(msgspec.structs.asdict(r))


def event_json(event: Event) -> dict[str, Any]:
    """The event as its JSON object, `kind` included (the incident-log line)."""
    data: dict[str, Any] = msgspec.to_builtins(event)
    return data


def findings_of(findings: Iterable[Finding], transfer_id: str) -> list[FindingOut]:
    return [finding_out(f) for f in findings if f.transfer_id == transfer_id]


def display_url(url: str) -> str:
    """The store URL with any password hidden, for answers and logs."""
    try:
        return parse_url(url).display
    except StoreError:
        return "<not a store URL>"
