"""`--jobs N`: a replay or audit folded in N processes, one partition of the log's transfers each, merged.

Each worker opens the logs itself (no reader funnels events to it) and folds the events of its
partition (`ledger.partitioned.fold_partition`). A single JSONL log, read without `--skip-bad-lines`
or a cut, is split line by line without decoding the other partitions' lines
(`ledger.jsonl.LogReader.partition_chunks`); anything else (several logs merged by time, a SQLite
store, skipped lines, `--until-*`) is decoded whole by every worker, which keeps its partition's events.
Each worker sends back its answer at the audit clock (`--now`, or the whole log's newest ts, which
every worker knows) msgpack-encoded; the parent merges them (`ledger.partitioned.merge`) into exactly
what one process gives. A worker's memory is its partition's fold; the parent holds the answers (the
releases and accepted maps, in compact form) while it merges.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from ledger.audit import AuditConfig
from ledger.inputs import Inputs, is_sqlite_file
from ledger.jsonl import LogFormatError, open_log
from ledger.merge import OverlapError
from ledger.partitioned import Merged, PartitionAnswer, answer, fold_partition, merge, slices

_answer_decoder = msgspec.msgpack.Decoder(PartitionAnswer)
_ERRORS: dict[str, type[Exception]] = {
    "LogFormatError": LogFormatError, "OverlapError": OverlapError, "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError, "ValueError": ValueError,
}  # fmt: skip
"""Errors a worker hits in the input, raised again in the parent as what they were (the CLI's message)."""


def cores() -> int:
    """The cores this process may run on: `--jobs`' default."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _fold(
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
    """One partition's answer, the lines skipped (the whole log's: every worker that skips reads them
    all) and the audit clock."""
    plain = len(paths) == 1 and not skip_bad and until_seq is None and until_ts is None
    if plain and Path(paths[0]).exists() and not is_sqlite_file(paths[0]):
        reader = open_log(paths[0])
        try:
            parts = reader.partition_chunks(partition, partitions)
            folded = fold_partition(parts, partition, partitions, keep_releases=keep_releases)
        finally:
            reader._stream.close()
        skipped: list[tuple[str, int, str]] = []
    else:
        with Inputs(list(paths), skip_bad_lines=skip_bad) as inputs:
            parts = slices(inputs.chunks(), partition, partitions, until_seq=until_seq, until_ts=until_ts)
            folded = fold_partition(parts, partition, partitions, keep_releases=keep_releases)
            skipped = inputs.skipped
    clock = now if now is not None else (folded.stream_last_ts or 0.0)
    return answer(folded, clock, config), skipped, clock


def _worker(conn: Connection, *args: Any) -> None:
    try:
        found, skipped, clock = _fold(*args)
        conn.send(("ok", skipped, clock))
        conn.send_bytes(msgspec.msgpack.encode(found))
    except BaseException as error:  # every failure goes back to the parent as one message
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
    try:
        for partition in range(jobs):
            parent, child = context.Pipe(duplex=False)
            args = ([str(p) for p in logs], partition, jobs, skip_bad, until_seq, until_ts, now, config, keep_releases)
            worker = context.Process(target=_worker, args=(child, *args), daemon=True)
            worker.start()
            child.close()
            pipes.append(parent)
            workers.append(worker)
        replies = [_receive(pipe) for pipe in pipes]
    finally:
        for pipe in pipes:
            pipe.close()
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    errors = [r for r in replies if r[0] == "error"]
    if errors:
        _raise_first(errors)
    _, skipped, clock, _ = replies[0]
    return merge(r[3] for r in replies), skipped, clock


def _receive(pipe: Connection) -> tuple[Any, ...]:
    try:
        message = pipe.recv()
        if message[0] == "error":
            return tuple(message)
        return (*message, _answer_decoder.decode(pipe.recv_bytes()))
    except EOFError:
        raise RuntimeError("a --jobs worker died before it answered") from None


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
