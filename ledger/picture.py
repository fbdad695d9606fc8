"""What the service's page, summary and metrics read of a fold besides its audit, as plain data whose parts
add up: a partition's `Picture` (made where the partition is folded) and the merge of every partition's into
the whole fold's (`merge_pictures`), so a service over partition workers answers as one process folding the
whole stream does.

Each part is exact under the merge: counters are added (each event is folded by one partition), a source's
newest ts is the largest of its partitions', the sides and blocks a source holds are added (a side lives in
its transfer's partition), and the stream's first map is the one at the least stream position. The rules
that read them (which source is lost: `kvledger.ledger.sources.judge`; the timeout advice's late count:
`kvledger.ledger.advice.late_after_expire`) have one home each, which the one-process service calls too.
Sans-IO.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kvledger.ledger.advice import late_after_expire
from kvledger.ledger.audit import AuditConfig, Finding, found_at
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.sources import held_by_source


class Picture(msgspec.Struct, kw_only=True, array_like=True):
    """One fold's (or partition's) figures beyond its audit."""

    held: dict[str, tuple[int, int]]
    """Every source with a side, in first-seen order: (transfer sides, blocks) its live sides hold."""
    last_ts: dict[str, float]
    """Each source's newest event ts (every event folded, whatever it did)."""
    events_by_kind: dict[str, int]
    forged_by_reason: dict[str, int]
    lease_counts: dict[str, int]
    live_by_phase: dict[str, int]
    """Live sides by phase (sorted by phase)."""
    late_after_expire: int
    """`late_event` findings on sides released by expiry, at the audit this picture goes with."""
    first_map: tuple[int, float] | None
    """(stream position, ts) of the first `map` event folded: where the blocks-held series starts."""
    holding_end_ts: float | None
    """The newest ts of the `map` events and of the events that released a side: where that series ends."""
    found_at: list[float]
    """When each of the audit's findings became true (`kvledger.ledger.audit.found_at`), in their order; merged,
    the partitions' lists one after the other, in the order the pictures came."""


def live_by_phase(state: LedgerState) -> dict[str, int]:
    """Live sides by phase, sorted by phase (the metrics' `kvledger_live_transfers_by_phase`)."""
    counts: dict[str, int] = {}
    for t in state.live.values():
        counts[t.phase] = counts.get(t.phase, 0) + 1
    return dict(sorted(counts.items()))


def picture_of(
    state: LedgerState,
    findings: Sequence[Finding],
    config: AuditConfig | None,
    *,
    last_ts: dict[str, float],
    events_by_kind: dict[str, int],
    first_map: tuple[int, float] | None,
    holding_end_ts: float | None,
) -> Picture:
    """A fold's picture: `state` audited (with `config`) into `findings`, with what the folding loop counted
    beside the fold."""
    return Picture(
        held=held_by_source(state),
        last_ts=dict(last_ts),
        events_by_kind=dict(events_by_kind),
        forged_by_reason=dict(state.forged_by_reason),
        lease_counts=dict(state.lease_counts),
        live_by_phase=live_by_phase(state),
        late_after_expire=late_after_expire(state, findings),
        first_map=first_map,
        holding_end_ts=holding_end_ts,
        found_at=[found_at(f, state, config) for f in findings],
    )


def _added(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for key, n in part.items():
            out[key] = out.get(key, 0) + n
    return out


def merge_pictures(parts: Sequence[Picture]) -> Picture:
    """Every partition's picture as the whole fold's."""
    held: dict[str, tuple[int, int]] = {}
    last_ts: dict[str, float] = {}
    for p in parts:
        for source, (sides, blocks) in p.held.items():
            had = held.get(source, (0, 0))
            held[source] = (had[0] + sides, had[1] + blocks)
        for source, ts in p.last_ts.items():
            if ts > last_ts.get(source, 0.0):
                last_ts[source] = ts
    firsts = [p.first_map for p in parts if p.first_map is not None]
    ends = [p.holding_end_ts for p in parts if p.holding_end_ts is not None]
    return Picture(
        held=held,
        last_ts=last_ts,
        events_by_kind=_added(p.events_by_kind for p in parts),
        forged_by_reason=_added(p.forged_by_reason for p in parts),
        lease_counts=_added(p.lease_counts for p in parts),
        live_by_phase=dict(sorted(_added(p.live_by_phase for p in parts).items())),
        late_after_expire=sum(p.late_after_expire for p in parts),
        first_map=min(firsts) if firsts else None,
        holding_end_ts=max(ends) if ends else None,
        found_at=[at for p in parts for at in p.found_at],
    )
