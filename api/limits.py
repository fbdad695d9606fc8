"""The service's named limits: how much one page shows, how often the audits are rebuilt, fold slices, plot sizes."""

from __future__ import annotations

from kvledger.ledger.limits import SNAPSHOT_COST_FACTOR as SNAPSHOT_COST_FACTOR  # one rule: ledger.limits

GROUPS_SHOWN_MAX = 40
"""Finding groups (code x source) on the front page, worst first; the findings page pages through the rest."""

GROUP_ROWS_SHOWN = 5
"""Transfers shown inside a group when it is expanded on the front page."""

FINDINGS_PAGE_ROWS = 50
"""Transfers on one page of a group (or groups on one page of all groups)."""

BOARD_COST_FACTOR = 10
"""A rebuild of the page's audit is started at most once per this many times the last one took, so a
ledger with 100k findings (an audit of a second or more) spends at most a tenth of a core on it."""

BOARD_SYNC_BUILD_MAX_S = 0.05
"""A stale audit that rebuilds this fast is rebuilt before answering (the page is never behind a small
ledger); a slower one is rebuilt in the background while the page shows the last one with its time."""

STORE_PROBE_TIMEOUT_S = 0.1
"""How long the page waits for the store to say whether it holds events the fold has not read; past it the
page says the store did not answer (it never waits on a hung store)."""

PLOT_WIDTH_PX = 860
PLOT_HEIGHT_PX = 230
PLOT_SOURCES_MAX = 10
"""Sources drawn in the blocks-held plot (the largest holders; the rest are counted under it)."""

PLOT_BARS = 60
"""Time bars in the findings-over-time plot."""

PLOT_LATENCY_BINS_PER_DECADE = 5
"""Release-latency histogram bins per factor of ten (log scale: latencies span microseconds to minutes)."""

GC_FREEZE_SIDES_MIN = 10_000
"""A ledger loaded with this many transfer sides or more is frozen out of the garbage collector's full
passes at startup (`gc.freeze`): with 100k findings they paused every request for up to seconds."""


AUDIT_COST_FACTOR = 10
"""The audit that requests without `?now=` read (`kvledger.api.live.Live.audit_forever`) is computed at most
once per this many times the last one took: it holds the fold lock meanwhile, so ingest folds at least
nine tenths of the time however large the ledger (the rule of SNAPSHOT_COST_FACTOR and BOARD_COST_FACTOR)."""

FOLD_SLICE_EVENTS = 1000
"""Events folded on the event loop in one go (a few milliseconds at a million events' fold); a larger batch
(ingest takes up to 10,000 events) is folded a slice at a time, requests served in between."""

GIL_SWITCH_INTERVAL_S = 0.0005
"""The running service's `sys.setswitchinterval`: how long the event loop waits for the GIL while another
thread holds it busy before it is handed over. Against CPython's 5 ms, GET /audit's p99 while ingest runs and
while a snapshot is written is a few milliseconds lower, and HTTP ingest is faster, the appending thread and
the fold handing over sooner (benchmarks/api.py, the two alternating on one machine)."""


def frozen_at_start(sides: int) -> bool:
    """Whether a service that starts with `sides` transfer sides freezes them (GC_FREEZE_SIDES_MIN)."""
    return sides >= GC_FREEZE_SIDES_MIN
