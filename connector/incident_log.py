"""Each connector process appends its ledger's events to a JSONL incident log (`incident_log_dir`).

One file per process life, `<source with '/' as '.'>.<pid>.jsonl`, so that a
restarted engine never writes a second seq 1 into an old file. Events are
buffered by the listener (called under the log's lock, so no syscall per event
is needed) and flushed once per step by the adapter, so a killed process loses
at most its last step.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import LogWriter
from kvledger.ledger.ledger import Ledger


class IncidentLog:
    """Subscribes to a ledger's log and writes every event appended from now on."""

    def __init__(self, ledger: Ledger, directory: str) -> None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{ledger.source.replace('/', '.')}.{os.getpid()}.jsonl"
        self._lock = ledger.log.lock
        self._writer = LogWriter(self.path, source=ledger.source)
        self._writer.flush()
        self._unsubscribe = ledger.log.subscribe(self._on_event)
        self._closed = False

    def _on_event(self, event: Event) -> None:
        self._writer.write(event)

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._writer.flush()

    def close(self) -> None:
        self._unsubscribe()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._writer.close()
