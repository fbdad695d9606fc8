"""One transfer's events from the store, bounded: what its JSON detail and its web page both show."""

from __future__ import annotations

from itertools import islice

from kvledger.ledger.events import Event, TransferId
from kvledger.ledger.store.base import EventStore


def transfer_events(store: EventStore, transfer_id: str, events_max: int) -> list[Event]:
    """Up to `events_max + 1` events of `transfer_id` in store order: one more than shown tells the caller
    that the list was cut. Blocking: call it through `Live.store_call`."""
    events = store.read(transfer_id=TransferId(transfer_id))
    try:
        return list(islice(events, events_max + 1))
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()  # a generator over a database cursor: release it now, not at garbage collection
