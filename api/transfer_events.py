"""One transfer's events from the store, bounded: what its JSON detail and its web page both show."""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, Protocol

from fastapi import HTTPException

from kvledger.ledger.events import Event, TransferId
from kvledger.ledger.side import TransferState
from kvledger.ledger.store.base import EventStore

if TYPE_CHECKING:
    from kvledger.api.live import Live


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


class Transfers(Protocol):
    """One transfer id's sides and events, as the page's transfer view reads them (`app.state.transfers`): the
    one-process service's fold (`LiveTransfers`) or partition workers' (`kvledger.api.fleet.Fleet`)."""

    async def sides(self, transfer_id: str) -> list[TransferState]: ...

    async def events(self, transfer_id: str, events_max: int) -> list[Event]:
        """As `transfer_events`."""
        ...


class LiveTransfers:
    """`Transfers` over the one-process service's live fold and its store."""

    def __init__(self, live: Live) -> None:
        self.live = live

    async def sides(self, transfer_id: str) -> list[TransferState]:
        state = self.live.state
        return [t for s in state.sources if (t := state.transfers.get((s, TransferId(transfer_id)))) is not None]

    async def events(self, transfer_id: str, events_max: int) -> list[Event]:
        store = self.live.store
        if store is None:
            raise HTTPException(503, f"store unavailable: {self.live.store_error}")
        return await self.live.store_call(transfer_events, store, transfer_id, events_max)
