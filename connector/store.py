"""The one hookup between `ledger_url` and persistence: opens this process's ledger.

In-memory is the source of truth inside a running connector (appends never wait
on a disk). `ledger.store` (being written) will attach here: open the store by
URL, reload this source's events, refold, and drain new events to it in the
background. Until then a URL is validated (config.py) and acknowledged in the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from connector.config import ConnectorConfig
from ledger.ledger import Ledger

log = logging.getLogger(__name__)


def open_ledger(config: ConnectorConfig, source: str, *, clock: Callable[[], float] = time.time) -> Ledger:
    """This process's ledger for `source`; persistence by `config.ledger_url` is wired here."""
    ledger = Ledger(source, clock=clock)
    if config.ledger_url is not None and not config.ledger_url.startswith("memory"):
        log.warning(
            "ledger_url %s accepted; persistence is not wired into the connector yet, events stay in memory",
            config.ledger_url.split("@")[-1],
        )
    return ledger
