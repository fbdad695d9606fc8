"""The one hookup between `ledger_url` and persistence: opens this process's ledger.

In-memory is the source of truth inside a running connector: appends never wait
on a disk or a network. With a `ledger_url` the store is opened at start (a bad
URL fails the engine's start with the store's message), this source's stored
events are reloaded and refolded so a restarted engine continues with the same
state and the next seq, and a background writer drains new events to the store;
when the store is slow or down they spill to local files and are loaded back
later. `Ledger.close()` (called at the connector's shutdown) flushes the writer.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.reasons import REASON_ENGINE_RESTARTED
from kvledger.ledger.events import Fail
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.store.url import StoreUrl, parse_url

log = logging.getLogger(__name__)


SPILL_DIR_DEFAULT = "kvledger-spill"
"""Where spill files go when the store is not a local SQLite file (relative to the working directory)."""


def spill_dir(store_url: StoreUrl, source: str) -> Path:
    """One spill folder per source: next to a SQLite store's file (`ledger.db.spill/`), else under
    `kvledger-spill/`."""
    sqlite_path = store_url.sqlite_path
    base = Path(f"{sqlite_path}.spill") if sqlite_path is not None else Path(SPILL_DIR_DEFAULT)
    return base / re.sub(r"[^A-Za-z0-9_.-]", "_", source)


def open_ledger(
    config: ConnectorConfig,
    source: str,
    *,
    clock: Callable[[], float] = time.time,
    tombstones_max: int | None = None,
) -> Ledger:
    """This process's ledger for `source`, persisted to `config.ledger_url` when one is set.

    A reopened ledger holds what the running one held: its refold forgets decided sides as the cores'
    maintenance does (`defer_timeout_s` after their decision), within the tombstone bound
    (`tombstones_max`, default `TOMBSTONES_MAX`)."""
    store_url = parse_url(config.ledger_url) if config.ledger_url is not None else None
    if store_url is None or store_url.is_memory:
        ledger = Ledger(source, clock=clock)
        if tombstones_max is not None:
            ledger.state.tombstones_max = tombstones_max
        return ledger
    from kvledger.ledger.store.connect import open_store
    from kvledger.ledger.store.recovery import open_ledger as reopen
    from kvledger.ledger.store.writer import BackgroundWriter

    store = open_store(store_url, create=True)
    spill = spill_dir(store_url, source)
    try:
        ledger = reopen(
            store, source, spill_dir=spill, clock=clock, retain_s=config.defer_timeout_s, tombstones_max=tombstones_max
        )
    except BaseException:
        store.close()
        raise
    writer = BackgroundWriter(store, spill).start()
    ledger.log.subscribe(writer.put)
    ledger.on_close(store.close)
    ledger.on_close(writer.close)
    log.info("ledger %s persists to %s (next seq %d)", source, store_url.display, ledger.log.next_seq)
    return ledger


def abandon_inherited(ledger: Ledger) -> int:
    """A new process's first act on its ledger: fail every side the previous process left live.

    A ledger reopened from the store holds the sides that were live when the previous process
    stopped. Their requests and their blocks died with it: vLLM never had these requests (naming one
    in finished_sending or finished_recving fails its `assert req_id in self.requests`), and their
    block ids are free in the new process (holding them would collide with new requests' blocks).
    Each is failed now (the log says why, and the transfer id stays used) and the releases are
    dropped: there is no request to finish and, in this process, no peer known to tell. A peer that
    still holds blocks for such a transfer frees them at its own deadline. Returns how many."""
    inherited = [t.transfer_id for t in ledger.state.live.values()]
    if not inherited:
        return 0
    now, source = ledger.clock(), ledger.source
    ledger.extend(Fail(ts=now, source=source, transfer_id=tid, reason=REASON_ENGINE_RESTARTED) for tid in inherited)
    ledger.take_releases()
    log.warning("%s: %d transfers in flight when the previous process stopped were failed", source, len(inherited))
    return len(inherited)
