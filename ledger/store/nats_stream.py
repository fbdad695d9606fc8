"""A `nats://host:port/stream` store URL: the JetStream stream's settings and its subjects (no nats-py here).

One stream holds the events. Each message is a batch of one source's events of one partition, on the
subject `<stream>.ev.<partition>.<source token>`: a partition worker filters `<stream>.ev.<p>.>`, a
reader of one source `<stream>.ev.*.<token>`. The partition is `kvledger.ledger.partition.partition_of_event`
(the transfer id's, 0 for a `drop`) over the stream's partition count, which is fixed when the stream is
created (written into its metadata; a URL asking for another count is refused: moving a transfer to another
partition would split its events between two workers).

The settings a user would want written down, each a URL query parameter (`?replicas=3`):

- storage: file (a restarted server keeps every event); `replicas` (1) for a clustered JetStream.
- duplicate window (`dup_window_s`, 600 s): a batch published again within it (the writer retrying after
  a lost acknowledgement) is stored once by its `Nats-Msg-Id`. The writer's longest wait between two
  attempts is `WRITER_RETRY_BACKOFF_S_MAX`; the window must exceed it (checked). A batch republished
  after the window (a spill file loaded after a long outage) is still stored once: the store checks each
  source's stored seqs before it publishes (`ledger.store.nats`).
- retention: limits with discard *new* and no age limit. A full stream (`max_bytes`, `max_msgs`, both
  unlimited by default) refuses new batches, which the writer then spills and retries, instead of deleting
  the oldest events, which nobody might have read. If events are removed anyway (an operator purges the
  stream or edits its limits), the store reports them: `NatsStore.missing_messages()` and the service's
  `store` problem name how many messages are gone.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from kvledger.ledger.store.base import StoreUnavailable
from kvledger.ledger.store.limits import WRITER_RETRY_BACKOFF_S_MAX

NATS_SCHEME = "nats"
CURSOR_SHIFT = 16
"""A cursor is `stream_seq << CURSOR_SHIFT | place`; a message holds fewer than 2**16 events."""
PARTITIONS_DEFAULT = 16
"""Partitions of a new stream: enough to spread over 16 workers; a worker may fold several."""
DUP_WINDOW_S_DEFAULT = 600.0
"""Ten minutes: many times the writer's longest retry wait, so a retried batch is caught by its Msg-Id."""

_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOKEN_SAFE = re.compile(r"[A-Za-z0-9_/=:@+-]")
SOURCE_TOKENS_CACHED = 4096
"""Sources whose subject token is remembered: far more than one writer's (an engine's ranks and roles)."""


@dataclass(frozen=True)
class NatsTarget:
    """Where the stream is and how it is made."""

    servers: str
    """`nats://host:port` (several, comma separated, for a cluster)."""
    stream: str
    partitions: int | None = None
    """None: the stream's count, or PARTITIONS_DEFAULT for a new stream."""
    replicas: int = 1
    dup_window_s: float = DUP_WINDOW_S_DEFAULT
    max_bytes: int = -1
    max_msgs: int = -1
    connect_timeout_s: float = 2.0

    @property
    def display(self) -> str:
        return f"{self.servers}/{self.stream}"

    @property
    def subjects(self) -> str:
        return f"{self.stream}.ev.>"

    @property
    def quarantine_subject(self) -> str:
        return f"{self.stream}.quarantine"

    @property
    def quarantine_stream(self) -> str:
        return f"{self.stream}-quarantine"

    @property
    def snapshot_bucket(self) -> str:
        return f"{self.stream}-snapshots"

    def subject(self, partition: int, source: str) -> str:
        return f"{self.stream}.ev.{partition}.{source_token(source)}"

    def partition_filter(self, partition: int) -> str:
        return f"{self.stream}.ev.{partition}.>"

    def source_filter(self, source: str) -> str:
        return f"{self.stream}.ev.*.{source_token(source)}"


@functools.lru_cache(maxsize=SOURCE_TOKENS_CACHED)
def source_token(source: str) -> str:
    """A source as one subject token, reversibly: characters a subject cannot hold (`.`, `*`, `>`,
    spaces) and `%` are written as `%XX` of their UTF-8 bytes; the empty source is `%`. Remembered for the
    last SOURCE_TOKENS_CACHED sources (a pure function: the memo changes its cost, never its answer), as
    each of an append's messages names one."""
    if not source:
        return "%"
    return "".join(c if _TOKEN_SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode()) for c in source)


def parse_nats_url(raw: str) -> NatsTarget:
    """`nats://host:port/stream?partitions=16&replicas=1&dup_window_s=600&max_bytes=-1&max_msgs=-1`."""
    parts = urlsplit(raw)
    where = raw.split("?")[0]
    if not parts.hostname:
        raise StoreUnavailable(f"{where}: a NATS store URL names a server: nats://host:4222/stream")
    stream = parts.path.strip("/")
    if not _STREAM_NAME.fullmatch(stream):
        raise StoreUnavailable(
            f"{where}: the path names the stream (letters, digits, '_' and '-', up to 64): nats://host:4222/kvledger"
        )
    try:
        port = parts.port or 4222
    except ValueError:
        raise StoreUnavailable(f"{where}: not a port number") from None
    known = {"partitions": int, "replicas": int, "dup_window_s": float, "max_bytes": int, "max_msgs": int}
    values: dict[str, int | float] = {}
    for name, given in parse_qs(parts.query, keep_blank_values=True).items():
        if name not in known:
            raise StoreUnavailable(f"{where}: unknown setting {name!r}; known: {', '.join(known)}")
        try:
            values[name] = known[name](given[-1])
        except ValueError:
            raise StoreUnavailable(f"{where}: setting {name!r} is not a number: {given[-1]!r}") from None
    target = NatsTarget(f"nats://{parts.hostname}:{port}", stream, **values)  # type: ignore[arg-type]
    if (target.partitions is not None and target.partitions < 1) or target.replicas < 1:
        raise StoreUnavailable(f"{where}: partitions and replicas must be at least 1")
    if target.dup_window_s <= WRITER_RETRY_BACKOFF_S_MAX:
        raise StoreUnavailable(
            f"{where}: dup_window_s {target.dup_window_s} must exceed the writer's longest retry wait "
            f"({WRITER_RETRY_BACKOFF_S_MAX} s), or a retried batch could be stored twice"
        )
    return target
