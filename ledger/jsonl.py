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
from typing import IO, Any, TypeAlias

import msgspec

from kvledger.ledger.events import Event
from kvledger.ledger.limits import JSONL_CHUNK_BYTES, JSONL_HEADER_DEPTH_MAX, JSONL_LINE_BYTES_MAX
from kvledger.ledger.partition import partition_of_event
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
_ts_of = attrgetter("ts")
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

    def __init__(
        self, stream: IO[bytes], name: str, *, skip_bad_lines: bool = False, check: bool = True, end: int | None = None
    ) -> None:
        self._stream = stream
        self.end = end
        """Read no further than this offset (None: to the end): a log still written to reads the same to every
        reader that is given one end (`--jobs`' workers)."""
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
        for chunk in self._whole_lines():
            yield self._decode(chunk)

    def _whole_lines(self) -> Iterator[bytes]:
        """The stream in pieces of about `JSONL_CHUNK_BYTES`, each ending at the end of a line (or of the
        stream)."""
        read, readline = self._stream.read, self._stream.readline
        left = -1 if self.end is None else max(0, self.end - self._stream.tell())
        while left:
            chunk = read(JSONL_CHUNK_BYTES if left < 0 else min(JSONL_CHUNK_BYTES, left))
            if not chunk:
                return
            if not chunk.endswith(b"\n"):
                rest = JSONL_LINE_BYTES_MAX + 1
                chunk += readline(rest if left < 0 else min(rest, left - len(chunk)))
            if left > 0:
                left -= len(chunk)
            yield chunk

    def _decode(self, chunk: bytes) -> list[Event]:
        """The events of `chunk` (whole lines), the line count moved past them."""
        # Fast path: decode a chunk of whole lines at once; only a chunk that fails is
        # decoded again line by line, to name the exact line and field.
        events = self._decode_fast(chunk)
        if events is None:
            return list(self._line_by_line(chunk))
        self.line += _newlines(chunk) + (0 if chunk.endswith(b"\n") else 1)
        return events

    def _decode_fast(self, chunk: bytes) -> list[Event] | None:
        """The events of `chunk` decoded at once, or None where a line must be looked at alone."""
        try:
            events = _event_decoder.decode_lines(chunk)
        except _DECODE_ERRORS:
            return None
        # Checked, seq >= 1 is one of the chunk check's rules; unchecked, it is looked at alone.
        odd = not json_chunk_valid(events, chunk) if self.check else bool(events) and min(map(_seq_of, events)) < 1
        if odd or (len(chunk) > JSONL_LINE_BYTES_MAX and max(map(len, chunk.split(b"\n"))) > JSONL_LINE_BYTES_MAX):
            return None
        return events

    def marked_chunks(self, partitions: int, *, stride: int = 1, first: int = 0) -> Iterator[tuple[int, Marked | None]]:
        """Every `stride`-th chunk from the `first`: its length and its `line_marks` (None for a chunk
        `partition_chunks` decodes whole). What one of `stride` workers tells the others, so that each line
        is scanned once however many partitions read it."""
        for k, chunk in enumerate(self._whole_lines()):
            if k % stride == first:
                yield len(chunk), line_marks(chunk, partitions) if len(chunk) <= JSONL_LINE_BYTES_MAX else None

    def partition_chunks(
        self, partition: int, partitions: int, marked: Iterable[tuple[int, Marked | None]] | None = None
    ) -> Iterator[tuple[list[Event], list[int], int, float]]:
        """`chunks` as partition `partition` of `partitions` folds them (`kvledger.ledger.partitioned.fold_partition`):
        each chunk's events of the partition, their positions in the whole log, how many events the
        chunk holds and its newest ts. Lines of other partitions are told by `line_marks` and never
        decoded; a chunk where that is not enough (a bad or very long line) is decoded whole, as `chunks`
        decodes it, so a bad line fails here as it does there. `marked`: each chunk's length and marks
        (`marked_chunks`, possibly another reader's; None: decode the chunk whole), else this reader marks
        each chunk itself. Not with `skip_bad_lines` (see `line_marks`)."""
        if self.skip_bad_lines:
            raise ValueError("partition_chunks reads a log whose bad lines fail it, not one that skips them")
        told = iter(marked) if marked is not None else None
        index = 0
        for chunk in self._whole_lines():
            events: list[Event] | None = None
            if told is not None:
                length, marks = next(told, (-1, None))
                if length != len(chunk):
                    raise ValueError(f"{self.name}: the log changed while it was read (a chunk of another length)")
            else:
                marks = line_marks(chunk, partitions) if len(chunk) <= JSONL_LINE_BYTES_MAX else None
            if marks is not None:
                kept, ordinals, unsure = select_lines(chunk, marks[0], marks[1], partition)
                count, newest = marks[2], marks[3]
                events = self._decode_fast(kept)
                if events is not None and len(events) != len(ordinals):
                    events = None
            if events is None:  # the whole chunk, as `chunks` reads it
                everything = self._decode(chunk)
                count = len(everything)
                newest = max(map(_ts_of, everything), default=float("-inf"))
                ordinals = [k for k, e in enumerate(everything, 1) if partition_of_event(e, partitions) == partition]
                events = [everything[k - 1] for k in ordinals]
            else:
                self.line += _newlines(chunk) + (0 if chunk.endswith(b"\n") else 1)
                if unsure:
                    others = set()
                    for k in unsure:
                        event = events[k]
                        if event.ts > newest:
                            newest = event.ts
                        if partition_of_event(event, partitions) != partition:
                            others.add(k)
                    if others:
                        events = [e for k, e in enumerate(events) if k not in others]
                        ordinals = [o for k, o in enumerate(ordinals) if k not in others]
            yield events, [index + o for o in ordinals], count, newest
            index += count

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


def _crc_table() -> list[int]:
    """zlib's crc32 table: 256 words (compiled, a C array of them: ledger/jsonl.pxd)."""
    words = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (0xEDB88320 ^ (c >> 1)) if c & 1 else c >> 1
        words.append(c)
    return words


_CRC32 = _crc_table()
_SPECIAL = bytes(1 if byte in (10, 34, 92) else 0 for byte in range(256))
"""The bytes `split_lines` stops at: newline, quote, backslash."""
_TRANSFER_ID = b'transfer_id"'
# Bytes below by value (a module name would be a Python object compiled): 10 newline, 34 '"', 44 ',',
# 46 '.', 58 ':', 92 backslash, 125 '}', 48-57 digits.


Marked: TypeAlias = tuple[bytes, bytes, int, float]
"""`line_marks` of a chunk: its lines' marks, their ends, its events and its newest plain ts."""
LINE_BLANK = 254
"""`line_marks`' mark for a blank line (no event)."""
LINE_UNSURE = 255
"""`line_marks`' mark for a line decoding must tell: every partition keeps it."""
MARKED_PARTITIONS_MAX = 254
"""Partitions a line's mark can name (0 to 253), beside the two marks above."""


def split_lines(chunk: bytes, partition: int, partitions: int) -> tuple[bytes, list[int], list[int], int, float]:
    """The lines of `chunk` (whole JSONL event lines) that partition `partition` of `partitions` folds, told
    without decoding them (`line_marks`, then `select_lines`): the kept lines joined; each one's position among
    the chunk's events (1-based); the positions among the kept of the lines decoding must tell; how many events
    the chunk holds; and the newest ts of the plain lines (`-inf` when none)."""
    marks, ends, events, newest = line_marks(chunk, partitions)
    kept, ordinals, unsure = select_lines(chunk, marks, ends, partition)
    return kept, ordinals, unsure, events, newest


def line_marks(chunk: bytes, partitions: int) -> tuple[bytes, bytes, int, float]:
    """Each line of `chunk` (whole JSONL event lines) marked with the partition of `partitions` that folds it,
    told without decoding it: a line names its transfer once (`"transfer_id":"ID"`) and its ts once
    (`"ts":NUMBER`), and the partition is `kvledger.ledger.partition.partition_of(ID)` (crc32 of the id's
    bytes: with no backslash in the line, the JSON string's bytes are the id's UTF-8).

    A line that is not that plain (a backslash, either key twice or not followed at once by its value,
    a `"drop"`, which partition 0 folds whatever its transfer) is marked `LINE_UNSURE`: every partition keeps
    it, to be told by decoding it; a blank line `LINE_BLANK`. Returns the marks, one byte a line in order (a
    last line without its newline included); where each line ends, 4 bytes a line (`_put_end`: what
    `select_lines` cuts at); how many events the chunk holds (its lines that are not blank); and the newest ts
    of the plain lines (`-inf` when none). At most `MARKED_PARTITIONS_MAX` partitions. A chunk is at most
    JSONL_CHUNK_BYTES plus one line, so its offsets fit 4 bytes.

    Only for a log read without skipping bad lines: the counts take every line that is not blank for an
    event, which is what the fold sees when the log is valid; when it is not, reading it fails anyway,
    on its first bad line, which the partition keeping that line decodes. Compiled (ledger/jsonl.pxd),
    one C loop over the bytes (about two thirds of decoding them); interpreted, the same loop, slowly."""
    if not 1 <= partitions <= MARKED_PARTITIONS_MAX:
        raise ValueError(f"partitions must be 1 to {MARKED_PARTITIONS_MAX}, got {partitions}")
    data = chunk
    special = _SPECIAL
    word = _TRANSFER_ID
    size = len(chunk)
    count = _newlines(chunk) + 1
    out = bytearray(count)
    marks = out
    out_ends = bytearray(4 * count)
    ends = out_ends
    lines = 0
    events = 0
    newest = float("-inf")
    best_start = best_end = -1  # the greatest plain decimal ts seen: parsed once, at the end
    start = 0
    while start < size:
        i = start
        odd = False
        ids = stamps = 0
        id_start = ts_start = -1
        while i < size:
            c = data[i]
            if not special[c]:  # most bytes: one load and one test
                i += 1
                continue
            if c == 10:
                break
            if c == 34:
                if i + 4 < size and data[i + 1] == 116 and data[i + 2] == 115 and data[i + 3] == 34:  # "ts"
                    stamps += 1
                    if data[i + 4] == 58:
                        ts_start = i + 5
                elif i + 14 < size and data[i + 1] == 116 and data[i + 2] == 114:  # "tr...
                    k = 1
                    while k < 13 and data[i + k] == word[k - 1]:
                        k += 1
                    if k == 13:  # "transfer_id"
                        ids += 1
                        if data[i + 13] == 58 and data[i + 14] == 34:
                            id_start = i + 15
                elif (
                    i + 5 < size and data[i + 1] == 100 and data[i + 2] == 114 and data[i + 3] == 111
                    and data[i + 4] == 112 and data[i + 5] == 34
                ):  # fmt: skip
                    odd = True  # "drop": partition 0's, whatever its transfer
            else:  # a backslash
                odd = True
            i += 1
        line_start = start
        start = i + 1 if i < size else size
        if not ids and not stamps and not odd:  # no key: blank (not an event), or a line decoding must tell
            k = line_start
            while k < i and (data[k] == 32 or data[k] == 9 or data[k] == 13):
                k += 1
            if k == i:
                marks[lines] = LINE_BLANK
                _put_end(ends, lines, start)
                lines += 1
                continue
        events += 1
        if odd or ids != 1 or stamps != 1 or id_start < 0 or ts_start < 0:
            marks[lines] = LINE_UNSURE
            _put_end(ends, lines, start)
            lines += 1
            continue
        crc = 0xFFFFFFFF
        id_end = id_start
        while id_end < i and data[id_end] != 34:
            crc = (crc >> 8) ^ _CRC32[(crc ^ data[id_end]) & 0xFF]
            id_end += 1
        crc ^= 0xFFFFFFFF
        ts_end = ts_start
        plain = ts_start < i and 48 <= data[ts_start] <= 57
        dots = 0
        while ts_end < i and data[ts_end] != 44 and data[ts_end] != 125:  # up to ',' or '}'
            c = data[ts_end]
            if c == 46:
                dots += 1
            elif not 48 <= c <= 57:
                plain = False
            ts_end += 1
        if plain and dots <= 1:
            if best_start < 0 or _decimal_greater(data, ts_start, ts_end, best_start, best_end):
                best_start, best_end = ts_start, ts_end
        else:
            try:
                ts = float(chunk[ts_start:ts_end])
            except ValueError:
                ts = newest  # not a number: the line is bad, and the partition keeping it says so
            if ts > newest:
                newest = ts
        marks[lines] = crc % partitions
        _put_end(ends, lines, start)
        lines += 1
    if best_start >= 0:
        ts = float(chunk[best_start:best_end])
        if ts > newest:
            newest = ts
    return bytes(out[:lines]), bytes(out_ends[: 4 * lines]), events, newest


def _put_end(ends: bytearray, line: int, end: int) -> None:
    """Write where line `line` ends (the offset of the byte after its newline), 4 bytes little-endian."""
    k = 4 * line
    ends[k] = end & 0xFF
    ends[k + 1] = (end >> 8) & 0xFF
    ends[k + 2] = (end >> 16) & 0xFF
    ends[k + 3] = end >> 24


def select_lines(chunk: bytes, marks: bytes, ends: bytes, partition: int) -> tuple[bytes, list[int], list[int]]:
    """The lines of `chunk` that `marks` and `ends` (`line_marks` of it) give to `partition`, with the unsure
    ones every partition keeps: joined; each one's position among the chunk's events (1-based); the positions
    among the kept of the unsure ones. Only the kept lines are touched: their bounds come from `ends`."""
    lines = len(marks)
    if 4 * lines != len(ends) or (lines and _end_of(ends, lines - 1) != len(chunk)):
        raise ValueError(f"{lines} line marks for a chunk of other lines: the log changed while it was read")
    data = marks
    kept: list[bytes] = []
    ordinals: list[int] = []
    unsure: list[int] = []
    events = 0
    start = 0
    for line in range(lines):
        mark = data[line]
        end = _end_of(ends, line)
        if mark != LINE_BLANK:
            events += 1
            keep = mark == partition
            if mark == LINE_UNSURE:
                unsure.append(len(kept))
                keep = True
            if keep:
                kept.append(chunk[start:end])
                ordinals.append(events)
        start = end
    return b"".join(kept), ordinals, unsure


def _end_of(ends: bytes, line: int) -> int:
    """Where line `line` ends (`_put_end`)."""
    k = 4 * line
    return ends[k] | (ends[k + 1] << 8) | (ends[k + 2] << 16) | (ends[k + 3] << 24)


def _decimal_greater(data: bytes, a: int, a_end: int, b: int, b_end: int) -> bool:
    """Whether the plain decimal (digits, at most one dot, no leading zero: JSON's) at `data[a:a_end]` is
    greater than the one at `data[b:b_end]`, or equal to it written longer; never False when greater."""
    a_int = a
    while a_int < a_end and data[a_int] != 46:
        a_int += 1
    b_int = b
    while b_int < b_end and data[b_int] != 46:
        b_int += 1
    if a_int - a != b_int - b:
        return a_int - a > b_int - b
    while a < a_end and b < b_end:
        if data[a] != data[b]:
            return data[a] > data[b]
        a += 1
        b += 1
    return a < a_end


def open_log(
    path: str | os.PathLike[str], *, skip_bad_lines: bool = False, check: bool = True, end: int | None = None
) -> LogReader:
    """Open a JSONL incident log for reading (the caller closes `reader._stream` via `read_events`); `end`: read
    no further than this offset."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    return LogReader(open(p, "rb"), str(p), skip_bad_lines=skip_bad_lines, check=check, end=end)


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
