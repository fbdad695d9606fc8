"""Open what a user hands over as a log: a JSONL incident log or a SQLite ledger store file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from itertools import islice
from pathlib import Path

from ledger.events import Event
from ledger.jsonl import LogReader, open_log
from ledger.limits import REPLAY_BATCH_EVENTS
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

    def chunks(self) -> Iterator[list[Event]]:
        """The merged stream in lists, for `replay_chunks`: a single JSONL log comes in its
        reader's decoded chunks, without a generator step per event."""
        if len(self.paths) == 1 and self.paths[0].exists() and not is_sqlite_file(self.paths[0]):
            reader = self._open_jsonl(self.paths[0])
            return reader.chunks()
        events = self.events()
        return iter(lambda: list(islice(events, REPLAY_BATCH_EVENTS)), [])

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
                streams.append(iter(self._open_jsonl(path)))
                names.append(str(path))
        if len(streams) == 1:
            return streams[0]
        return merge(streams, names=names)

    def _open_jsonl(self, path: Path) -> LogReader:
        reader = open_log(path, skip_bad_lines=self.skip_bad_lines)
        self._stack.callback(reader._stream.close)
        self.readers.append(reader)
        return reader

    def bytes_read(self) -> int:
        """How far the JSONL readers are, for a progress bar."""
        return sum(r._stream.tell() for r in self.readers if not r._stream.closed)

    def _store_streams(self, path: Path) -> list[tuple[str, Iterator[Event]]]:
        from ledger.store.connect import open_store

        store = open_store(str(path))
        self._stack.callback(store.close)
        return [(source, store.read(source=source)) for source in sorted(store.sources())]
