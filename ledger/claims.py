"""What a partition's fold tells the merge's block ownership (`kvledger.ledger.ownership.Ownership`): each map it
accepted (`Claim`) and each side it decided (`Free`), at their positions in the whole stream.

Interpreted: the compiled ownership reads these as C structs (ledger/structs.pxd), so their layout is one the
compiled fold is built for (ledger/compiled.py, LAYOUT_SOURCES).
"""

from __future__ import annotations

import msgspec

from kvledger.ledger.events import ReqId, TransferId


class Claim(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A map a partition accepted (its side now holds `block_ids` on `source`): what `Ownership` reads."""

    index: int
    """The map's position in the whole stream."""
    source: str
    transfer_id: TransferId
    request_id: ReqId
    block_ids: tuple[int, ...]
    map_seq: int


class Free(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A side decided (its blocks let go of) at its event's position in the whole stream: what `Ownership`
    reads of a release."""

    index: int
    source: str
    transfer_id: TransferId
