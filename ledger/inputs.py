"""Open what a user hands over as a log: a JSONL incident log or a SQLite ledger store file."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import LogReader, open_log
from kvledger.ledger.merge import batched, merge_chunks

SQLITE_MAGIC = b"SQLite format 3\x00"


def is_sqlite_file(path: str | os.PathLike[str]) -> bool:
    """A regular file that begins with SQLite's magic. A pipe (`/dev/stdin`, `<(...)`) is never one: SQLite
    needs a file it can seek in, and peeking at a pipe would eat the start of the log."""
    if not Path(path).is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


class Inputs:
    """One merged, time-ordered event stream over several logs; `skipped` reports bad lines.

    Use as a context manager: files and stores are closed on exit.
    """

    def __init__(self, paths: list[str | os.PathLike[str]], *, skip_bad_lines: bool = False) -> None:
        if not paths:
            raise ValueError("no log given")
        self.paths = [Path(p) for p in paths]
        self.skip_bad_lines = skip_bad_lines
        self.readers: list[LogReader] = []
        self._stack = ExitStack()

    def __enter__(self) -> Inputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def skipped(self) -> list[tuple[str, int, str]]:
        return [(r.name, line, why) for r in self.readers for line, why in r.skipped]

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    def chunks(self) -> Iterator[list[Event]]:
        """The merged stream in lists, for `replay_chunks`: JSONL logs come in their readers'
        decoded chunks and are merged chunk by chunk, without a generator step per event."""
        streams, names = self._streams()
        if len(streams) == 1:
            return iter(streams[0])
        return merge_chunks(streams, names=names)

    def events(self) -> Iterator[Event]:
        return (event for chunk in self.chunks() for event in chunk)

    def _streams(self) -> tuple[list[Iterable[list[Event]]], list[str]]:
        streams: list[Iterable[list[Event]]] = []
        names: list[str] = []
        for path in self.paths:
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file")
            if is_sqlite_file(path):
                for source, stream in self._store_streams(path):
                    streams.append(batched(stream))
                    names.append(f"{path} ({source})")
            else:
                streams.append(self._open_jsonl(path).chunks())
                names.append(str(path))
        return streams, names

    def _open_jsonl(self, path: Path) -> LogReader:
        reader = open_log(path, skip_bad_lines=self.skip_bad_lines)
        self._stack.callback(reader._stream.close)
        self.readers.append(reader)
        return reader

    def bytes_read(self) -> int:
        """How far the JSONL readers are, for a progress bar (a pipe counts as nothing read)."""
        return sum(_position(r._stream) for r in self.readers if not r._stream.closed)

    def _store_streams(self, path: Path) -> list[tuple[str, Iterator[Event]]]:
        from kvledger.ledger.store.connect import open_store

        store = open_store(str(path))
        self._stack.callback(store.close)
        return [(source, store.read(source=source)) for source in sorted(store.sources())]


def _position(stream: IO[bytes]) -> int:
    try:
        return stream.tell()
    except OSError:
        return 0  # a pipe: no position
