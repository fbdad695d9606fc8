"""Open what a user hands over as a log: a JSONL incident log or a SQLite ledger store file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

from ledger.events import Event
from ledger.jsonl import LogReader, open_log
from ledger.merge import merge

SQLITE_MAGIC = b"SQLite format 3\x00"


def is_sqlite_file(path: str | os.PathLike[str]) -> bool:
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

    def events(self) -> Iterator[Event]:
        streams: list[Iterator[Event]] = []
        names: list[str] = []
        for path in self.paths:
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file")
            if is_sqlite_file(path):
                for source, stream in self._store_streams(path):
                    streams.append(stream)
                    names.append(f"{path} ({source})")
            else:
                reader = open_log(path, skip_bad_lines=self.skip_bad_lines)
                self._stack.callback(reader._stream.close)
                self.readers.append(reader)
                streams.append(iter(reader))
                names.append(str(path))
        if len(streams) == 1:
            return streams[0]
        return merge(streams, names=names)

    def bytes_read(self) -> int:
        """How far the JSONL readers are, for a progress bar."""
        return sum(r._stream.tell() for r in self.readers if not r._stream.closed)

    def _store_streams(self, path: Path) -> list[tuple[str, Iterator[Event]]]:
        from ledger.store.connect import open_store

        store = open_store(str(path))
        self._stack.callback(store.close)
        return [(source, store.read(source=source)) for source in sorted(store.sources())]
