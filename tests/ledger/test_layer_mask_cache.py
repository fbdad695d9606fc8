"""The fold's cache of layer bitmasks (`Fold.layer_masks`) is bounded: however many distinct layer tuples a
log names, it never holds more than `LAYER_MASKS_CACHED_MAX` of them, and what it holds is each tuple's
mask."""

from __future__ import annotations

from kvledger.ledger.events import TransferId
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.limits import LAYER_MASKS_CACHED_MAX
from kvledger.ledger.side import layers_mask
from tests.ledger.builders import Side


def test_the_layer_mask_cache_never_holds_more_than_its_bound() -> None:
    p = Side("prefill-0/tp0", start_ts=0.0, step_s=0.0)
    state = LedgerState()
    state.apply(p.map("tx-1", "w-1", "producer", "write", deadline=1e9))
    most = 0
    for i in range(LAYER_MASKS_CACHED_MAX + 2):
        state.apply(p.schedule("tx-1", (100 + i,), op="write"))  # past 64 layers: the handler's path, cached
        most = max(most, len(state.layer_masks))
    assert most == LAYER_MASKS_CACHED_MAX
    assert 0 < len(state.layer_masks) < LAYER_MASKS_CACHED_MAX  # cleared when full, then filled again
    assert all(mask == layers_mask(layers) for layers, mask in state.layer_masks.items())
    side = state.live[(p.source, TransferId("tx-1"))]
    assert side.scheduled_mask == layers_mask(tuple(range(100, 100 + LAYER_MASKS_CACHED_MAX + 2)))
