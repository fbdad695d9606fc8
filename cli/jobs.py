"""`--jobs N`: a replay or audit folded in N processes, one partition of the log's transfers each, merged.

Each worker opens the logs itself (no reader funnels events to it) and folds the events of its
partition (`kvledger.ledger.partitioned.fold_partition`). A single JSONL log, read without `--skip-bad-lines`
or a cut, is split line by line without decoding the other partitions' lines
(`kvledger.ledger.jsonl.LogReader.partition_chunks`); anything else (several logs merged by time, a SQLite
store, skipped lines, `--until-*`) is decoded whole by every worker, which keeps its partition's events.
Each worker sends, msgpack-encoded, batches of its releases' sides and accepted maps as it folds, then
its answer at the audit clock (`--now`, or the whole log's newest ts, which every worker knows); the
parent merges what every worker has told up to a stream position as it comes
(`kvledger.ledger.partitioned.Merger`) and ends with exactly what one process gives. A worker's memory is its
partition's fold; the parent's, the live sides' block ownership and what one worker told ahead of the
slowest (and the releases themselves for `replay --json`, which prints them).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import msgspec

from kvledger.ledger.audit import AuditConfig
from kvledger.ledger.inputs import Inputs, is_sqlite_file
from kvledger.ledger.jsonl import LogFormatError, open_log
from kvledger.ledger.merge import OverlapError
from kvledger.ledger.partitioned import Batch, Merged, Merger, PartitionAnswer, answer, fold_partition, slices

_answer_decoder = msgspec.msgpack.Decoder(PartitionAnswer)
_batch_decoder = msgspec.msgpack.Decoder(Batch)
_encode = msgspec.msgpack.Encoder().encode
_ERRORS: dict[str, type[Exception]] = {
    "LogFormatError": LogFormatError, "OverlapError": OverlapError, "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError, "ValueError": ValueError,
}  # fmt: skip
"""Errors a worker hits in the input, raised again in the parent as what they were (the CLI's message)."""


def cores() -> int:
    """The cores this process may run on (benchmarks/replay.py times `--jobs` up to them)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _fold(
    conn: Connection,
    paths: list[str],
    partition: int,
    partitions: int,
    skip_bad: bool,
    until_seq: int | None,
    until_ts: float | None,
    now: float | None,
    config: AuditConfig | None,
    keep_releases: bool,
) -> tuple[PartitionAnswer, list[tuple[str, int, str]], float]:
    """One partition's answer, its batches sent on `conn` as it folds; the lines skipped (the whole log's:
    every worker that skips reads them all) and the audit clock."""

    def emit(batch: Batch) -> None:
        conn.send_bytes(b"b" + _encode(batch))

    plain = len(paths) == 1 and not skip_bad and until_seq is None and until_ts is None
    if plain and Path(paths[0]).exists() and not is_sqlite_file(paths[0]):
        reader = open_log(paths[0])
        try:
            parts = reader.partition_chunks(partition, partitions)
            folded = fold_partition(parts, partition, partitions, keep_releases=keep_releases, emit=emit)
        finally:
            reader._stream.close()
        skipped: list[tuple[str, int, str]] = []
    else:
        with Inputs(list(paths), skip_bad_lines=skip_bad) as inputs:
            parts = slices(inputs.chunks(), partition, partitions, until_seq=until_seq, until_ts=until_ts)
            folded = fold_partition(parts, partition, partitions, keep_releases=keep_releases, emit=emit)
            skipped = inputs.skipped
    clock = now if now is not None else (folded.stream_last_ts or 0.0)
    return answer(folded, clock, config), skipped, clock


def _worker(conn: Connection, *args: Any) -> None:
    try:
        found, skipped, clock = _fold(conn, *args)
        conn.send_bytes(b"a" + _encode(found))
        conn.send(("ok", skipped, clock))
    except BaseException as error:  # every failure goes back to the parent as one message
        conn.send_bytes(b"e")
        conn.send(("error", type(error).__name__, str(error), _error_args(error)))
    finally:
        conn.close()


def _error_args(error: BaseException) -> tuple[Any, ...]:
    if isinstance(error, LogFormatError):
        return (error.path, error.line, error.message)
    if isinstance(error, OSError) and error.filename is not None:
        return (error.errno, error.strerror, error.filename)
    return tuple(error.args)


def fold_jobs(
    logs: list[Path],
    jobs: int,
    *,
    until_seq: int | None = None,
    until_ts: float | None = None,
    skip_bad: bool = False,
    now: float | None = None,
    config: AuditConfig | None = None,
    keep_releases: bool = False,
) -> tuple[Merged, list[tuple[str, int, str]], float]:
    """Fold `logs` in `jobs` processes and merge: the merged answer (its releases only with `keep_releases`),
    the skipped lines and the audit clock.
    A bad input fails as one process fails on it (its first bad line: the least line any worker met)."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    context = multiprocessing.get_context("fork")
    pipes: list[Connection] = []
    workers = []
    merger = Merger(jobs)
    replies: dict[int, tuple[Any, ...]] = {}
    try:
        for partition in range(jobs):
            parent, child = context.Pipe(duplex=False)
            args = ([str(p) for p in logs], partition, jobs, skip_bad, until_seq, until_ts, now, config, keep_releases)
            worker = context.Process(target=_worker, args=(child, *args), daemon=True)
            worker.start()
            child.close()
            pipes.append(parent)
            workers.append(worker)
        # Read every worker as it sends (a worker whose pipe is full waits), merging what all have told.
        reading = {pipe: partition for partition, pipe in enumerate(pipes)}
        while reading:
            for pipe in wait(list(reading)):
                partition = reading[pipe]  # type: ignore[index]
                reply = _receive(pipe, partition, merger)  # type: ignore[arg-type]
                if reply is not None:
                    replies[partition] = reply
                    del reading[pipe]  # type: ignore[arg-type]
    finally:
        for pipe in pipes:
            pipe.close()
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    errors = [r for r in replies.values() if r[0] == "error"]
    if errors:
        _raise_first(errors)
    _, skipped, clock, _ = replies[0]
    return merger.finish([r[3] for r in replies.values()]), skipped, clock


def _receive(pipe: Connection, partition: int, merger: Merger) -> tuple[Any, ...] | None:
    """One message of a worker: a batch (merged; None), or its end: ("ok", skipped, clock, answer) or
    ("error", kind, message, args)."""
    try:
        message = pipe.recv_bytes()
        if message[:1] == b"b":
            merger.add(partition, _batch_decoder.decode(message[1:]))
            return None
        found = _answer_decoder.decode(message[1:]) if message[:1] == b"a" else None
        end = pipe.recv()
    except EOFError:
        raise RuntimeError("a --jobs worker died before it answered") from None
    if end[0] == "error":
        return tuple(end)
    return (*end, found)


def _raise_first(errors: list[tuple[Any, ...]]) -> None:
    """Raise what one process would: of the workers' errors in the input, the one at the least line."""
    formats = [e for e in errors if e[1] == "LogFormatError"]
    kind, message, args_ = min(formats, key=lambda e: e[3][1])[1:] if formats else errors[0][1:]
    cls = _ERRORS.get(kind)
    if cls is None:
        raise RuntimeError(f"a --jobs worker failed: {kind}: {message}")
    if cls is ValueError:
        raise ValueError(message)
    raise cls(*args_)
