"""Request id -> transfer id, a projection of the log's `map` events (vLLM speaks request ids only).

Not bookkeeping beside the ledger: it is rebuilt by replaying the same maps, and
an entry is forgotten once the transfer's release has been handed to vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

from kvledger.ledger.events import Event, Map, ReqId, TransferId
from kvledger.ledger.log import EventLog


class RequestIndex:
    def __init__(self, log: EventLog | None = None) -> None:
        """Fed by `log`'s every event where one is given (a worker's ledger has several appenders), else by
        its owner's `put` of each map it appends (the scheduler core, its ledger's only appender: no
        listener call per event on vLLM's step path)."""
        self._by_request: dict[ReqId, TransferId] = {}
        self.get: Callable[[ReqId], TransferId | None] = self._by_request.get
        """The transfer of a request, or None: the dict's own `get` (no Python frame per lookup)."""
        self.put: Callable[[ReqId, TransferId], None] = self._by_request.__setitem__
        """A map its owner appended, as (request, transfer): the entry `on_event` makes."""
        if log is not None:
            log.subscribe(self.on_event)

    def on_event(self, event: Event) -> None:
        # Called under the log's lock, in seq order: must be quick and must not append.
        if type(event) is Map:
            self.put(event.request_id, event.transfer_id)

    def forget(self, request_id: ReqId, transfer_id: TransferId) -> None:
        if self._by_request.get(request_id) == transfer_id:
            del self._by_request[request_id]

    def __len__(self) -> int:
        return len(self._by_request)
