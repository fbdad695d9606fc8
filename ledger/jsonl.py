"""The incident-log interchange format: JSON Lines, one header line, then one event a line.

Reading streams and checks every line against the one definition of a valid event
(`kvledger.ledger.valid`); an error names the file, the line number and the field. With
`skip_bad_lines` the reader reports what it skipped instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from operator import attrgetter
from pathlib import Path
from typing import IO, Any

import msgspec

from kvledger.ledger.events import Event
from kvledger.ledger.limits import JSONL_CHUNK_BYTES, JSONL_HEADER_DEPTH_MAX, JSONL_LINE_BYTES_MAX
from kvledger.ledger.valid import event_problem, json_chunk_valid

try:
    import cython
except ImportError:  # no Cython here: this module runs as Python
    COMPILED = False
else:
    COMPILED = cython.compiled

FORMAT = "kvledger"
VERSION = 1


class Header(msgspec.Struct, kw_only=True):
    format: str
    version: int
    source: str | None = None
    created_ts: float | None = None
    meta: dict[str, Any] = {}


class LogFormatError(ValueError):
    """A line of an incident log that is not what the format says; names where."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        self.message = message
        super().__init__(f"{path}:{line}: {message}")


_header_decoder = msgspec.json.Decoder(Header)
_event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
_seq_of = attrgetter("seq")
_encoder = msgspec.json.Encoder()
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)
"""What decoding untrusted JSON may raise (RecursionError only past `_nesting`'s check, as a backstop)."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def _nesting(raw: bytes) -> int:
    """How deep the JSON text `raw` nests arrays and objects (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub(b'""', raw)):
        depth += 1 if bracket in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def _describe(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "nested too deep"
    text = str(error)
    # msgspec says "... - at `$.field`"; name the field in words.
    if " - at `$." in text:
        message, _, path = text.partition(" - at `$.")
        return f"field {path.rstrip('`')!r}: {message}"
    return text


class LogReader:
    """Iterate the events of a JSONL incident log, checking each line.

    `skipped` lists `(line number, message)` of bad lines passed over when
    `skip_bad_lines` is set; without it the first bad line raises
    `LogFormatError`. The header is read at construction. Without `check`, events
    that are well-typed but not valid (`kvledger.ledger.valid`) are passed on: a writer's own
    spill files, whose events the store itself then checks and quarantines.
    """

    def __init__(self, stream: IO[bytes], name: str, *, skip_bad_lines: bool = False, check: bool = True) -> None:
        self._stream = stream
        self.name = name
        self.skip_bad_lines = skip_bad_lines
        self.check = check
        self.skipped: list[tuple[int, str]] = []
        self.line = 0
        self.header = self._read_header()

    def _read_header(self) -> Header:
        raw = self._stream.readline(JSONL_LINE_BYTES_MAX + 1)
        self.line = 1
        if not raw:
            raise LogFormatError(self.name, 1, "empty file: expected the kvledger header line")
        if _nesting(raw) > JSONL_HEADER_DEPTH_MAX:
            # Events have no free-form field, so only the header's `meta` can nest: bounded here, before a
            # decoder recurses into it.
            raise LogFormatError(
                self.name, 1, f"not a kvledger header (nested too deep: more than {JSONL_HEADER_DEPTH_MAX} levels)"
            )
        try:
            header = _header_decoder.decode(raw)
        except _DECODE_ERRORS as error:
            raise LogFormatError(
                self.name,
                1,
                f'not a kvledger header ({_describe(error)}); expected {{"format": "{FORMAT}", "version": {VERSION}}}',
            ) from None
        if header.format != FORMAT:
            raise LogFormatError(self.name, 1, f"field 'format': {header.format!r} is not {FORMAT!r}")
        if header.version != VERSION:
            raise LogFormatError(
                self.name,
                1,
                f"field 'version': unknown version {header.version} (this reader knows {VERSION})",
            )
        return header

    def __iter__(self) -> Iterator[Event]:
        for chunk in self.chunks():
            yield from chunk

    def chunks(self) -> Iterator[list[Event]]:
        """The events in lists of up to `JSONL_CHUNK_BYTES` of lines: a replay folds each list
        without a generator step per event."""
        # Fast path: decode a chunk of whole lines at once; only a chunk that fails is
        # decoded again line by line, to name the exact line and field.
        decode_lines = _event_decoder.decode_lines
        read, readline = self._stream.read, self._stream.readline
        while True:
            chunk = read(JSONL_CHUNK_BYTES)
            if not chunk:
                return
            if not chunk.endswith(b"\n"):
                chunk += readline(JSONL_LINE_BYTES_MAX + 1)
            try:
                events = decode_lines(chunk)
            except _DECODE_ERRORS:
                yield list(self._line_by_line(chunk))
                continue
            # Checked, seq >= 1 is one of the chunk check's rules; unchecked, it is looked at alone.
            odd = not json_chunk_valid(events, chunk) if self.check else bool(events) and min(map(_seq_of, events)) < 1
            if odd or (len(chunk) > JSONL_LINE_BYTES_MAX and max(map(len, chunk.split(b"\n"))) > JSONL_LINE_BYTES_MAX):
                yield list(self._line_by_line(chunk))
                continue
            self.line += _newlines(chunk) + (0 if chunk.endswith(b"\n") else 1)
            yield events

    def _line_by_line(self, chunk: bytes) -> Iterator[Event]:
        decode = _event_decoder.decode
        for raw in chunk.splitlines(keepends=True):
            self.line += 1
            if len(raw) > JSONL_LINE_BYTES_MAX:
                error = f"line longer than {JSONL_LINE_BYTES_MAX} bytes"
            elif not raw.strip():
                continue
            else:
                try:
                    event = decode(raw)
                except _DECODE_ERRORS as exc:
                    error = _describe(exc)
                    if not raw.endswith(b"\n"):
                        error = f"truncated last line ({error})"
                else:
                    found = event_problem(event) if self.check else None
                    if found is not None:
                        error = f"field {found[0]!r}: {found[1]}"
                    elif event.seq < 1:
                        error = f"field 'seq': must be >= 1, got {event.seq}"
                    else:
                        yield event
                        continue
            if not self.skip_bad_lines:
                raise LogFormatError(self.name, self.line, error)
            self.skipped.append((self.line, error))


def _newlines(chunk: bytes) -> int:
    """How many lines `chunk` ends. Compiled (ledger/jsonl.pxd), a loop over its bytes that the C compiler
    vectorizes, several times faster than `bytes.count`'s byte-at-a-time loop."""
    if not COMPILED:
        return chunk.count(b"\n")
    n = 0
    for byte in chunk:
        n += byte == 10  # a newline
    return n


def open_log(path: str | os.PathLike[str], *, skip_bad_lines: bool = False, check: bool = True) -> LogReader:
    """Open a JSONL incident log for reading (the caller closes `reader._stream` via `read_events`)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    return LogReader(open(p, "rb"), str(p), skip_bad_lines=skip_bad_lines, check=check)


def read_events(path: str | os.PathLike[str], *, skip_bad_lines: bool = False, check: bool = True) -> Iterator[Event]:
    """Stream a log's events, closing the file when done."""
    for chunk in read_chunks(path, skip_bad_lines=skip_bad_lines, check=check):
        yield from chunk


def read_chunks(
    path: str | os.PathLike[str], *, skip_bad_lines: bool = False, check: bool = True
) -> Iterator[list[Event]]:
    """`read_events`, in the reader's decoded lists (see `LogReader.chunks`)."""
    reader = open_log(path, skip_bad_lines=skip_bad_lines, check=check)
    try:
        yield from reader.chunks()
    finally:
        reader._stream.close()


def header_line(source: str | None = None, created_ts: float | None = None, **meta: Any) -> bytes:
    return (
        _encoder.encode(Header(format=FORMAT, version=VERSION, source=source, created_ts=created_ts, meta=meta)) + b"\n"
    )


class LogWriter:
    """Append events to a JSONL incident log; writes the header when the file is new."""

    def __init__(self, path: str | os.PathLike[str], *, source: str | None = None, **meta: Any) -> None:
        self.path = Path(path)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file: IO[bytes] = open(self.path, "ab")  # noqa: SIM115
        if new:
            self._file.write(header_line(source, **meta))

    def write(self, event: Event) -> None:
        self._file.write(_encoder.encode(event) + b"\n")

    def write_many(self, events: Iterable[Event]) -> int:
        batch = list(events)
        self._file.write(_encoder.encode_lines(batch))
        return len(batch)

    def flush(self, *, fsync: bool = False) -> None:
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_log(path: str | os.PathLike[str], events: Iterable[Event], *, source: str | None = None) -> int:
    """Write a whole new log (replacing `path`); returns the number of events."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with LogWriter(tmp, source=source) as writer:
        n = writer.write_many(events)
    os.replace(tmp, p)
    return n
