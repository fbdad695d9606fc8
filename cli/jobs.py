"""`--jobs N`: a replay or audit folded in N processes, one partition of the log's transfers each, merged.

Each worker opens the logs itself (no reader funnels events to it) and folds the events of its
partition (`kvledger.ledger.partitioned.fold_partition`). A single JSONL log, read without `--skip-bad-lines`
or a cut, is read in two passes, each line scanned once in all: every worker marks every N-th chunk (each
line's partition and end, `kvledger.ledger.jsonl.LogReader.marked_chunks`) into a file of a temporary folder,
the workers meet at a barrier, and each then reads the log again and decodes only its partition's lines,
chunk k's marks taken from worker k mod N's file (`partition_chunks`). Every worker reads to the same
offset, the log's size when the run began, so a log still being written reads alike to all. Anything else
(several logs merged by time, a SQLite store, skipped lines, `--until-*`) is decoded whole by every worker,
which keeps its partition's events.
Each worker sends, msgpack-encoded, batches of its releases' sides and accepted maps as it folds, then
its answer at the audit clock (`--now`, or the whole log's newest ts, which every worker knows); the
parent merges what every worker has told up to a stream position as it comes
(`kvledger.ledger.partitioned.Merger`) and ends with exactly what one process gives. A worker's memory is its
partition's fold; the parent's, the live sides' block ownership and what one worker told ahead of the
slowest (and the releases themselves for `replay --json`, which prints them); the marks take 5 bytes a
line of temporary disk.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import msgspec

from kvledger.ledger.audit import AuditConfig
from kvledger.ledger.inputs import Inputs, is_sqlite_file
from kvledger.ledger.jsonl import MARKED_PARTITIONS_MAX, LogFormatError, Marked, open_log
from kvledger.ledger.merge import OverlapError
from kvledger.ledger.partitioned import (
    Batch,
    Folded,
    Merged,
    Merger,
    PartitionAnswer,
    answer,
    fold_partition,
    slices,
)

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


JOBS_AUTO_BYTES = 64 * 1024 * 1024
"""Logs this large or larger are folded on every core by default: below it (about 300k events) starting the
workers and merging cost about what they save."""


def default_jobs(logs: list[Path]) -> int:
    """`--jobs` left out: the cores, for regular files of `JOBS_AUTO_BYTES` or more in all; else 1 (a pipe is
    read once, by one process)."""
    try:
        size = sum(p.stat().st_size for p in logs if p.is_file())
    except OSError:
        return 1  # the one-process read names the file that fails
    return cores() if size >= JOBS_AUTO_BYTES else 1


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
    shared: _Shared | None,
) -> tuple[PartitionAnswer, list[tuple[str, int, str]], float]:
    """One partition's answer, its batches sent on `conn` as it folds; the lines skipped (the whole log's:
    every worker that skips reads them all) and the audit clock. With `shared` (one plain JSONL log), the
    workers first mark every `partitions`-th chunk each (`_mark`), then each folds its partition from
    everyone's marks."""

    def emit(batch: Batch) -> None:
        conn.send_bytes(b"b" + _encode(batch))

    if shared is not None:
        _mark(paths[0], partition, partitions, shared)
        folded = _fold_marked(paths[0], partition, partitions, shared, keep_releases, emit)
        skipped: list[tuple[str, int, str]] = []
    else:
        with Inputs(list(paths), skip_bad_lines=skip_bad) as inputs:
            parts = slices(inputs.chunks(), partition, partitions, until_seq=until_seq, until_ts=until_ts)
            folded = fold_partition(parts, partition, partitions, keep_releases=keep_releases, emit=emit)
            skipped = inputs.skipped
    clock = now if now is not None else (folded.stream_last_ts or 0.0)
    return answer(folded, clock, config), skipped, clock


class _Shared(NamedTuple):
    """What the workers of one plain JSONL log share: where they leave their marks, the offset they all read
    to, and the barrier they meet at once every chunk is marked."""

    folder: str
    end: int
    marked: Barrier


_RECORD = struct.Struct("<qqqd")
"""A chunk's record in a marks file: its length, its lines (-1: not marked), its events and its newest ts;
then its marks (a byte a line) and their ends (4 bytes a line), as `line_marks` gives them."""


def _mark(path: str, partition: int, partitions: int, shared: _Shared) -> None:
    """Mark every `partitions`-th chunk of the log from the `partition`-th into this worker's marks file, then
    wait for the others (a worker that fails breaks the barrier: the others stop too)."""
    try:
        reader = open_log(path, end=shared.end)
        with reader._stream, open(os.path.join(shared.folder, str(partition)), "wb") as out:
            write = out.write
            for length, marked in reader.marked_chunks(partitions, stride=partitions, first=partition):
                if marked is None:
                    write(_RECORD.pack(length, -1, 0, 0.0))
                else:
                    marks, ends, events, newest = marked
                    write(_RECORD.pack(length, len(marks), events, newest))
                    write(marks)
                    write(ends)
    except BaseException:
        shared.marked.abort()
        raise
    shared.marked.wait()


def _fold_marked(
    path: str,
    partition: int,
    partitions: int,
    shared: _Shared,
    keep_releases: bool,
    emit: Callable[[Batch], None],
) -> Folded:
    """Fold this worker's partition of the log, each chunk's marks read from the file of the worker that made
    them (chunk k: worker k mod `partitions`)."""
    files = [open(os.path.join(shared.folder, str(w)), "rb") for w in range(partitions)]  # noqa: SIM115
    try:
        reader = open_log(path, end=shared.end)
        with reader._stream:
            parts = reader.partition_chunks(partition, partitions, _records(files))
            return fold_partition(parts, partition, partitions, keep_releases=keep_releases, emit=emit)
    finally:
        for f in files:
            f.close()


def _records(files: Sequence[BinaryIO]) -> Iterator[tuple[int, Marked | None]]:
    """The chunks' records in log order: chunk k's from file k mod the number of files."""
    for k in itertools.count():
        f = files[k % len(files)]
        head = f.read(_RECORD.size)
        if len(head) < _RECORD.size:
            return
        length, lines, events, newest = _RECORD.unpack(head)
        if lines < 0:
            yield length, None
        else:
            marks = f.read(lines)
            yield length, (marks, f.read(4 * lines), events, newest)


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
    with tempfile.TemporaryDirectory(prefix="kvledger-jobs-") as folder:
        shared = None
        plain = len(logs) == 1 and not skip_bad and until_seq is None and until_ts is None
        if plain and jobs <= MARKED_PARTITIONS_MAX and logs[0].is_file() and not is_sqlite_file(str(logs[0])):
            shared = _Shared(folder, logs[0].stat().st_size, context.Barrier(jobs))
        return _run(context, logs, jobs, shared, (skip_bad, until_seq, until_ts, now, config, keep_releases))


def _run(
    context: Any, logs: list[Path], jobs: int, shared: _Shared | None, options: tuple[Any, ...]
) -> tuple[Merged, list[tuple[str, int, str]], float]:
    """Start the workers, merge what they send as it comes, and end with the merged answer."""
    pipes: list[Connection] = []
    workers = []
    merger = Merger(jobs)
    replies: dict[int, tuple[Any, ...]] = {}
    try:
        for partition in range(jobs):
            parent, child = context.Pipe(duplex=False)
            args = ([str(p) for p in logs], partition, jobs, *options, shared)
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
        _raise_first([e for e in errors if e[1] != "BrokenBarrierError"] or errors)  # the cause, not who waited
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
