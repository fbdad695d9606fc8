"""The `Map` event that opens a side in a ledger: one builder for the scheduler half (from a request's
params) and the workers (from the step's metadata), so both halves describe a transfer's side alike."""

from __future__ import annotations

from kvledger.connector.metadata import PeerRef
from kvledger.ledger.events import UNASSIGNED_SEQ, Map, Mode, ReqId, Role, TransferId


def side_map(
    *,
    ts: float,
    source: str,
    transfer_id: TransferId,
    request_id: ReqId,
    role: Role,
    mode: Mode,
    block_ids: tuple[int, ...],
    deadline: float,
    peer: PeerRef | None = None,
    remote_block_ids: tuple[int, ...] | None = None,
    block_groups: tuple[int, ...] | None = None,
    remote_block_groups: tuple[int, ...] | None = None,
    acks_expected: int = 1,
    seq: int = UNASSIGNED_SEQ,
) -> Map:
    """`peer`: the remote engine the params named (recorded as its label); None where the side has none
    (a READ producer does not know its reader) or the params named none. `seq`: the one the log will give
    it, where the caller knows (the log then keeps the event as built instead of copying it to stamp it)."""
    return Map(
        seq=seq,
        ts=ts,
        source=source,
        transfer_id=transfer_id,
        request_id=request_id,
        role=role,
        mode=mode,
        block_ids=block_ids,
        remote_block_ids=remote_block_ids,
        peer=peer.label if peer is not None else None,
        deadline=deadline,
        acks_expected=acks_expected,
        block_groups=block_groups,
        remote_block_groups=remote_block_groups,
    )
