"""A small incident for the API tests: one completed transfer, one leak, one late ack after an expire."""

from __future__ import annotations

from kvledger.ledger.events import Event
from tests.ledger.builders import Side

PRODUCER, CONSUMER = "prefill-0/tp0", "decode-0/tp0"
START_TS = 1000.0
AUDIT_NOW = 2000.0
"""Well past every deadline below: the leak is a leak at this time."""


def incident_events() -> list[Event]:
    p = Side(PRODUCER, start_ts=START_TS)
    c = Side(CONSUMER, start_ts=START_TS + 0.005)
    return [
        p.map("tx-ok", "p-ok", blocks=(1, 2, 3)),
        c.map("tx-ok", "c-ok", role="consumer", blocks=(7, 8, 9), remote=(1, 2, 3)),
        c.schedule("tx-ok"),
        c.ack("tx-ok", "read"),
        p.ack("tx-ok", "release"),
        p.map("tx-leak", "p-leak", blocks=(10, 11, 12, 13), deadline=START_TS + 5),
        p.map("tx-late", "p-late", blocks=(20, 21), deadline=START_TS + 1),
        p.expire("tx-late", ts=START_TS + 1),
        p.ack("tx-late", "release", ts=START_TS + 2),
    ]
