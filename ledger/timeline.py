"""The story of one transfer: every event of every side in time order, gaps, and each decision with why."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Ack, Drop, Event, Expire, Fail, Map, Schedule, Seal, kind_of
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.humanize import utc
from kvledger.ledger.side import TransferState, completed_by

BLOCKS_SHOWN_MAX = 8
"""Block ids spelled out in a map's description; the rest are counted."""


@dataclass(frozen=True)
class Row:
    ts: float
    gap_s: float
    source: str
    seq: int
    kind: str
    text: str
    decision: bool = False


@dataclass
class Timeline:
    transfer_id: str
    rows: list[Row] = field(default_factory=list)
    sides: list[TransferState] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)


def _layers(layers: tuple[int, ...] | None) -> str:
    if layers is None:
        return "all layers"
    if len(layers) > 6:
        return f"{len(layers)} layers {layers[0]}..{layers[-1]}"
    return "layers " + ",".join(map(str, layers))


def _blocks(block_ids: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, block_ids[:BLOCKS_SHOWN_MAX]))
    return f"[{shown}{', ...' if len(block_ids) > BLOCKS_SHOWN_MAX else ''}]"


def describe(event: Event, clock: Callable[[float], str] = utc) -> str:
    """One line a person reads without knowing the JSON; `clock` formats absolute times."""
    if isinstance(event, Map):
        remote = f", remote {len(event.remote_block_ids)} blocks" if event.remote_block_ids is not None else ""
        peer = f", peer {event.peer}" if event.peer else ""
        waits = f"; waits for {event.acks_expected} release ack(s)" if event.role == "producer" else ""
        return (
            f"{event.role} {event.request_id} ({event.mode} mode) holds {len(event.block_ids)} "
            f"block{'' if len(event.block_ids) == 1 else 's'} "
            f"{_blocks(event.block_ids)}{remote}{peer}{waits}; deadline {clock(event.deadline)}"
        )
    if isinstance(event, Schedule):
        how = "deferred (remote not ready)" if event.deferred else "issued"
        retry = f", retry {event.attempt}" if event.attempt else ""
        return f"{event.op} of {_layers(event.layers)} {how}{retry}"
    if isinstance(event, Seal):
        return f"forward done: {event.expected} layer operations to expect"
    if isinstance(event, Ack):
        if event.what == "release":
            return f"release ack from consumer rank {event.rank}"
        if event.what == "recv":
            return "all KV arrived at the consumer"
        return f"{event.what} done: {_layers(event.layers)}"
    if isinstance(event, Fail):
        return f"{'transient' if event.retryable else 'terminal'} failure: {event.reason}"
    if isinstance(event, Drop):
        return f"{event.message} from {event.sender} dropped ({event.reason}): not proven, not acted on"
    assert isinstance(event, Expire)
    return f"{event.deadline} deadline passed"


def why(release: Release, side: TransferState) -> str:
    """The evidence behind a release, in words."""
    if release.cause == "failed":
        return f"failed: {release.reason}" + (" (its blocks are load errors)" if release.load_error else "")
    if release.cause == "expired":
        return f"expired: {release.reason}" + (" (its blocks are load errors)" if release.load_error else "")
    evidence = completed_by(side)
    if evidence == "release_acks" and side.mode == "read":
        ranks = ",".join(map(str, sorted(side.release_ranks)))
        return f"completed: {side.acks_expected} release ack(s) arrived (ranks {ranks})"
    if evidence == "release_acks":
        return "completed: the consumer released the transfer"
    if evidence == "all_written":
        return f"completed: sealed at {side.expected} writes, all acked"
    if evidence == "recv":
        return "completed: all KV arrived (recv)"
    return "completed: every read finished"


def build(events: Iterable[Event], transfer_id: str) -> Timeline:
    """Fold the events of `transfer_id` (other transfers are skipped) into its timeline."""
    timeline = Timeline(transfer_id)
    state = LedgerState()
    previous: float | None = None
    for event in events:
        if event.transfer_id != transfer_id:
            continue
        release = state.apply(event)
        gap = 0.0 if previous is None else event.ts - previous
        previous = event.ts
        timeline.rows.append(Row(event.ts, gap, event.source, event.seq, kind_of(event), describe(event)))
        if release is not None:
            side = state.transfers[(release.source, release.transfer_id)]
            timeline.releases.append(release)
            text = f"RELEASE {len(release.block_ids)} blocks of {release.request_id}: {why(release, side)}"
            timeline.rows.append(Row(event.ts, 0.0, event.source, event.seq, "decision", text, decision=True))
    timeline.sides = list(state.transfers.values())
    return timeline
