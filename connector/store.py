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

from connector.config import ConnectorConfig
from ledger.ledger import Ledger

log = logging.getLogger(__name__)

SPILL_DIR_DEFAULT = "kvledger-spill"
"""Where spill files go when the store is not a local SQLite file (relative to the working directory)."""


def spill_dir(config: ConnectorConfig, source: str) -> Path:
    """One spill folder per source: next to a SQLite store, else under `kvledger-spill/`."""
    url = config.ledger_url or ""
    base = Path(url.removeprefix("sqlite:///") + ".spill") if url.startswith("sqlite:///") else Path(SPILL_DIR_DEFAULT)
    return base / re.sub(r"[^A-Za-z0-9_.-]", "_", source)


def open_ledger(config: ConnectorConfig, source: str, *, clock: Callable[[], float] = time.time) -> Ledger:
    """This process's ledger for `source`, persisted to `config.ledger_url` when one is set."""
    url = config.ledger_url
    if url is None or url.startswith("memory"):
        return Ledger(source, clock=clock)
    from ledger.store.connect import open_store
    from ledger.store.recovery import open_ledger as reopen
    from ledger.store.writer import BackgroundWriter

    store = open_store(url, create=True)
    spill = spill_dir(config, source)
    try:
        ledger = reopen(store, source, spill_dir=spill, clock=clock)
    except BaseException:
        store.close()
        raise
    writer = BackgroundWriter(store, spill).start()
    ledger.log.subscribe(writer.put)
    ledger.on_close(store.close)
    ledger.on_close(writer.close)
    log.info("ledger %s persists to %s (next seq %d)", source, url.split("@")[-1], ledger.log.next_seq)
    return ledger
