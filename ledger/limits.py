"""Every named limit of the ledger core, in one place (TigerBeetle style)."""

from __future__ import annotations

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
"""Every integer an event carries fits in 64 signed bits: the store's BIGINT seq column and its msgpack
bodies hold no more, and the API's schema says so."""

FORGED_KEPT_MAX = 256
"""Dropped (forged) control messages a state keeps as audit evidence; older ones stay counted only."""

TS_MAX = 253_402_300_799.0
"""The latest event time or map deadline (seconds since the epoch): 9999-12-31T23:59:59Z, the last second
a calendar clock can print. Times are also >= 0; larger values are a unit mistake (milliseconds)."""

SOURCE_CHARS_MAX = 200
"""Longest `source` name an event may carry (engine and rank, e.g. 'prefill-0/tp0'); the events table's
column is this wide."""

TRANSFER_ID_CHARS_MAX = 200
"""Longest transfer id an event may carry; the events table's column is this wide."""

EVIDENCE_SEQS_MAX = 32
"""Seqs kept per transfer per kind of anomaly (late, duplicate, over-ack)."""

DEADLINE_HEAP_SLACK = 4
"""The deadline heap is swept of decided sides when it holds this many times the live ones."""

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
"""MoRIIO's `transfer_timeout`: how long a transfer may sit without progress (the audits' stuck and orphan
sides), and how long a connector's read or write may keep failing transiently. The connector's default too."""

DEFAULT_DEFER_TIMEOUT_S = 60.0
"""MoRIIO's `defer_timeout`: how long a producer holds blocks for a remote decode. The connector's default too."""

DEFAULT_CLOCK_SKEW_S = 0.5
"""Wall-clock skew allowed between two machines before premature_release is reported."""

JSONL_LINE_BYTES_MAX = 1 << 20
"""An incident-log line longer than this is rejected (one event is a few hundred bytes)."""

JSONL_HEADER_DEPTH_MAX = 64
"""Nesting an incident log's header (its free-form `meta`) may have: deeper is a format error, decided
before decoding, so the answer never depends on how deep the caller's own stack already is."""

JSONL_CHUNK_BYTES = 1 << 17
"""Bytes of whole lines an incident-log reader decodes at once (a few hundred events: what they
allocate stays in the CPU's cache until the fold is done with them; 1 MiB decoded 25% slower)."""

FINDINGS_WORST_MAX = 10
"""How many findings a summary lists in full."""

REPLAY_COMPACT_EVERY = 16_384
"""Events between compactions of cleanly released sides during an offline replay."""

REPLAY_BATCH_EVENTS = 4_096
"""Events a replay folds at once when handed a plain stream (a JSONL log comes in its own chunks)."""

EXPORT_BATCH_EVENTS = 5_000
"""Events per transaction when `kvledger export` loads a log into a store."""

MAINTENANCE_INTERVAL_S = 5.0
"""How often a running ledger forgets old decided sides and trims its in-memory log."""

LOG_EVENTS_RETAINED_MAX = 1_000_000
"""Events a running ledger keeps in memory (older ones live in the store, if one is attached)."""

REPLAY_RETAIN_S = 60.0
"""Log seconds a replay keeps a cleanly released side before compacting it (late events still land on it)."""

LAYERS_MAX = 1 << 16
"""Layer numbers are below this (a layer set is a bitmask: this bounds it at 8 KiB)."""

RANKS_MAX = 1 << 12
"""Consumer ranks are below this (release acks are a bitmask of ranks too)."""

LAYER_MASKS_CACHED_MAX = 4096
"""Distinct layer tuples whose bitmask the fold remembers (a few per model: one per step's slice)."""

ID_WINDOW_S = 1800.0
"""How long a stamped transfer id (ledger/ids.py) is valid after its issue time: a RULE, not a memory bound.
An event of a stamped id past it, whose side is not held open, is judged by the event alone (a map refused,
anything else late: ledger/upkeep.py, rule S), so the fold may retire what it knows of the id and every
answer stays the same. Longer than any transfer's life: the proxy issues the id before the prefill is
queued, and a side lives at most its deadline, a lease's maximum (`kv_lease_max_s`, 480 s by default) past
the defer timeout; 30 minutes leaves more than 20 for queueing and clock skew between proxy and engines."""

ARRIVAL_LAG_S = 300.0
"""How far behind the upkeep's clock (log time in a replay, the service's clock running) an event may
arrive and still find its stamped id's tombstone: a tombstone is retired at window end plus this. An event
later than that and still inside its window (impossible in a time-ordered log; a store ingesting a spill
late) is counted as `behind_horizon` and the summary says its answers are not exact. Memory for stamped
ids is about (new sides per second) x (ID_WINDOW_S + ARRIVAL_LAG_S) tombstones."""

LOST_SILENCE_TRANSFER_TIMEOUTS = 3
"""A source holding blocks that has appended nothing for this many transfer timeouts is lost: its engine
is dead or hung, and what it holds went with it (shown apart, never counted as leaks). Three: longer than
the default defer_timeout (two transfer timeouts) plus one for the `expire` a running connector appends
when a deadline passes, so a live engine holding blocks is never taken for a lost one."""

SERIES_POINTS_MAX = 240
"""Time buckets a blocks-held series keeps per source (a plot's width in points); past it, neighbours merge."""

SERIES_BUCKET_MIN_S = 0.01
"""The narrowest bucket of a blocks-held series (one simulator step): it doubles as the log's span grows."""

SNAPSHOT_COST_FACTOR = 10
"""A snapshot is written at most once per this many times the CPU seconds the last one took (the copy and
its encoding), so that snapshots take at most a tenth of a core however large the fold and however fast
events come (the service's, api/snapshots.py `due`, and a partition worker's, `kvledger.ledger.fleet`): the
rule the page's audit rebuilds follow (BOARD_COST_FACTOR)."""

FLEET_SNAPSHOT_EVERY_S = 10.0
"""A partition worker saves its fold (and then acknowledges what the fold holds) at most this often while it
folds new events: after a crash its successor folds at most this much again."""

FLEET_SNAPSHOT_EVERY_EVENTS = 500_000
"""...or after this many events folded since its last save, whichever comes first."""
