"""`--jobs N`: a replay or audit folded in N processes, one partition of the log each, merged.

Each worker opens the logs itself and decodes every line (no reader funnels objects to it), folds the
events of its partition (`ledger.partitioned.fold_partition`), says how far the log's clock went, is
told the audit clock (the whole log's last ts, or `--now`), and sends back its answer, msgpack-encoded.
The parent merges the answers (`ledger.partitioned.merge`) into exactly what one process gives.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from ledger.audit import AuditConfig
from ledger.inputs import Inputs
from ledger.jsonl import LogFormatError
from ledger.merge import OverlapError
from ledger.partitioned import Merged, PartitionAnswer, answer, fold_partition, merge

_answer_decoder = msgspec.msgpack.Decoder(PartitionAnswer)
_ERRORS: dict[str, type[Exception]] = {
    "LogFormatError": LogFormatError, "OverlapError": OverlapError, "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError,
}  # fmt: skip
"""Errors a worker hits in the input, raised again in the parent as what they were (the CLI's message)."""


def cores() -> int:
    """The cores this process may run on: `--jobs`' default."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class WorkerError(Exception):
    def __init__(self, kind: str, message: str, args_: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.kind, self.message, self.error_args = kind, message, args_


def _worker(
    conn: Connection,
    paths: list[str],
    partition: int,
    partitions: int,
    skip_bad: bool,
    until_seq: int | None,
    until_ts: float | None,
) -> None:
    try:
        with Inputs(list(paths), skip_bad_lines=skip_bad) as inputs:
            folded = fold_partition(inputs.chunks(), partition, partitions, until_seq=until_seq, until_ts=until_ts)
            skipped = inputs.skipped
        conn.send(("folded", folded.last_ts, skipped))
        now, config = conn.recv()
        conn.send_bytes(msgspec.msgpack.encode(answer(folded, now, config)))
    except BaseException as error:  # every failure goes back to the parent as one message
        conn.send(("error", type(error).__name__, str(error), _error_args(error)))
    finally:
        conn.close()


def _error_args(error: BaseException) -> tuple[Any, ...]:
    if isinstance(error, LogFormatError):
        return (error.path, error.line, error.message)
    return tuple(error.args)


def _raise(kind: str, message: str, args_: tuple[Any, ...]) -> None:
    cls = _ERRORS.get(kind)
    if cls is None:
        if kind == "ValueError":
            raise ValueError(message)
        raise RuntimeError(f"a --jobs worker failed: {kind}: {message}")
    raise cls(*args_)


def fold_jobs(
    logs: list[Path],
    jobs: int,
    *,
    until_seq: int | None = None,
    until_ts: float | None = None,
    skip_bad: bool = False,
    now: float | None = None,
    config: AuditConfig | None = None,
) -> tuple[Merged, list[tuple[str, int, str]], float]:
    """Fold `logs` in `jobs` processes and merge: the merged answer, the skipped lines and the audit clock."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    context = multiprocessing.get_context("fork")
    pipes: list[Connection] = []
    workers = []
    try:
        for partition in range(jobs):
            parent, child = context.Pipe()
            args = ([str(p) for p in logs], partition, jobs, skip_bad, until_seq, until_ts)
            worker = context.Process(target=_worker, args=(child, *args), daemon=True)
            worker.start()
            child.close()
            pipes.append(parent)
            workers.append(worker)
        folded = [_receive(pipe) for pipe in pipes]
        lasts = [last for _, last, _ in folded if last is not None]
        clock = now if now is not None else (max(lasts) if lasts else 0.0)
        for pipe in pipes:
            pipe.send((clock, config))
        answers = [_answer_decoder.decode(pipe.recv_bytes()) for pipe in pipes]
    finally:
        for pipe in pipes:
            pipe.close()
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    return merge(answers), folded[0][2], clock


def _receive(pipe: Connection) -> tuple[str, float | None, list[tuple[str, int, str]]]:
    try:
        message = pipe.recv()
    except EOFError:
        raise RuntimeError("a --jobs worker died before it answered") from None
    if message[0] == "error":
        _raise(message[1], message[2], message[3])
    return message  # type: ignore[no-any-return]
