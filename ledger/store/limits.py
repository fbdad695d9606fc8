"""Every named limit of the store and its background writer, in one place."""

from __future__ import annotations

WRITER_QUEUE_EVENTS_MAX = 65_536
"""Events the writer holds in memory before it spills to the local file (a few MB)."""

WRITER_BATCH_EVENTS_MAX = 2_000
"""Events written in one transaction; large enough to amortise a commit, small enough to retry."""

WRITER_BATCH_AGE_S_MAX = 0.05
"""The oldest queued event waits at most this long before its batch is written."""

NATS_WRITER_BATCH_AGE_S_MAX = 0.2
"""The same for a writer to a NATS stream (`NatsStore.writer_batch_age_s_max`, a writer's default there). A batch
goes out as one message per (partition, source): at 50 ms an engine's batch of a few hundred events became
32 messages of about a dozen events, and per message the publish, the server's store, the worker's fetch and
its header parse were most of a fleet's CPU. On 2 cores, the fleet benchmark's service phase at 64k events/s
(in turn): 50 ms, lag p50 0.55-0.57 s, p99 1.7-1.9 s, `GET /audit` p99 35-40 ms; 200 ms, 0.43 s, 1.0-1.3 s,
18-21 ms (100 ms: 0.46 s, 1.2 s, 32 ms; 400 ms: 0.53 s, 1.4 s, 21 ms)."""

WRITER_IDLE_POLL_S = 0.002
"""How often `flush` looks whether the writer has written everything."""

WRITER_IDLE_WAIT_S = 0.5
"""How long an idle writer sleeps unless a put wakes it (the first event of a batch does): a backstop only."""

WRITER_RETRY_BACKOFF_S_MIN = 0.05
"""First wait after a failed batch; doubles per failure up to the maximum."""

WRITER_RETRY_BACKOFF_S_MAX = 2.0
"""Longest wait between attempts while the store is down."""

WRITER_CLOSE_TIMEOUT_S = 10.0
"""Default time `close()` gives the writer to flush before it spills what is left."""

SPILL_LOAD_EVENTS_MAX = WRITER_BATCH_EVENTS_MAX
"""Events loaded from a spill file per transaction when the store comes back."""

INSERT_ROWS_PER_STATEMENT = 1_000
"""Rows in one SQLite INSERT statement at most (six parameters each; fewer where the connection allows
fewer parameters: 999 before SQLite 3.32, `kvledger.ledger.store.sql.rows_per_insert`): an ingest's 1,000-event
batch in one statement. Each statement is a release and a retaking of the GIL by the appending thread, and
each retaking waits for the event loop, folding the batch before, to hand it over: in statements of 100 a
sustained ingest ran 76-77k events/s, in one 81-84k (benchmarks/api.py)."""

READ_CHUNK_ROWS = 1_000
"""Rows fetched per round trip when streaming a read (server-side cursor / yield_per)."""

TAIL_EVENTS_MAX = 10_000
"""The most events one `tail` call returns."""

SNAPSHOT_TAIL_EVENTS_MAX = 100_000
"""Recovery writes a new snapshot when it had to refold more events than this."""

KIND_CHARS_MAX = 16
"""Longest event kind ('schedule')."""

SQLITE_BUSY_TIMEOUT_MS = 5_000
"""How long a SQLite writer waits for another process's write lock before failing the batch."""

PG_CONNECT_TIMEOUT_S = 3
"""How long a PostgreSQL connection attempt may take before the batch fails and is retried."""

PG_LOCK_TIMEOUT_MS = 5_000
"""How long a PostgreSQL statement waits for a lock another session holds (a writer's table lock behind
someone's ALTER TABLE): then it fails, the writer spills and retries, the service answers 503."""

PG_STATEMENT_TIMEOUT_MS = 30_000
"""The longest a PostgreSQL statement may run (one batch, one page of a read); a migration too."""

SPILL_HEADER_PEEK_BYTES = 4096
"""Bytes read to see whether a spill file got its header line before a crash (a header is ~100 bytes)."""

QUARANTINE_READ_MAX = 1_000
"""Quarantined events one read returns (the service lists the newest; recovery reads one source's)."""

QUARANTINE_REASON_CHARS_MAX = 2_000
"""A quarantine reason is cut to this many characters (it quotes the store's error)."""
