"""Event encodings round-trip; the incident-log format names the line and field of bad input."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvledger.ledger.events import from_json, from_msgpack, to_json, to_msgpack
from kvledger.ledger.jsonl import LogFormatError, LogWriter, read_events, write_log
from kvledger.ledger.limits import JSONL_HEADER_DEPTH_MAX
from kvledger.ledger.merge import OverlapError, merge
from kvledger.ledger.synth import SynthConfig, generate
from tests.ledger.builders import Side


def _sample() -> list:
    p = Side("prefill-0/tp0")
    return [
        p.map("tx", "p-1", "producer", "write", blocks=(1, 2), remote=(3, 4), acks=2),
        p.schedule("tx", (0, 1), op="write", attempt=1, deferred=True),
        p.seal("tx", 2),
        p.ack("tx", "write", (0,), rank=1),
        p.fail("tx", "SQ full", retryable=True),
        p.expire("tx", "transfer"),
    ]


def test_every_kind_round_trips_through_json_and_msgpack() -> None:
    for event in _sample():
        assert from_json(to_json(event)) == event
        assert from_msgpack(to_msgpack(event)) == event
        assert to_json(event).startswith(b'{"kind":"')


def test_events_are_immutable_and_validated() -> None:
    event = _sample()[0]
    with pytest.raises(AttributeError):
        event.seq = 9  # type: ignore[misc]
    with pytest.raises(ValueError, match="acks_expected"):
        Side("p").map("tx", "r", acks=0)
    with pytest.raises(msgspec.ValidationError, match="kind"):
        from_json(b'{"kind":"teleport","ts":1,"source":"p","transfer_id":"t"}')


def test_a_maps_block_groups_must_add_up_to_its_blocks_each_way() -> None:
    base = Side("p").map("tx", "r", blocks=(1, 2, 3), remote=(4, 5))
    assert msgspec.structs.replace(base, block_groups=(2, 1), remote_block_groups=(0, 2)).block_groups == (2, 1)
    for field, groups in (("block_groups", (2, 2)), ("block_groups", (4, -1)), ("remote_block_groups", (1,))):
        with pytest.raises(ValueError, match=f"map.{field} must be counts"):
            msgspec.structs.replace(base, **{field: groups})
    with pytest.raises(msgspec.ValidationError, match="remote_block_groups"):
        from_json(to_json(base)[:-1] + b',"remote_block_groups":[3]}')  # decoding checks it too


def test_a_log_round_trips(tmp_path: Path) -> None:
    events = list(generate(SynthConfig(transfers=50, concurrency=8, fault_rate=0.3), seed=4))
    path = tmp_path / "incident.jsonl"
    assert write_log(path, events, source="both") == len(events)
    assert list(read_events(path)) == events


@pytest.mark.parametrize(
    ("content", "line", "needle"),
    [
        (b"", 1, "empty file"),
        (b'{"format":"other","version":1}\n', 1, "field 'format'"),
        (b'{"format":"kvledger","version":7}\n', 1, "unknown version 7"),
        (b"not json\n", 1, "not a kvledger header"),
        (b'{"format":"kvledger","version":1}\n{"kind":"warp","seq":1,"ts":1,"source":"p","transfer_id":"t"}\n',
         2, "field 'kind'"),
        (b'{"format":"kvledger","version":1}\n{"kind":"seal","seq":1,"ts":1,"source":"p","transfer_id":"t","expected":"x"}\n',
         2, "field 'expected'"),
        (b'{"format":"kvledger","version":1}\n{"kind":"seal","seq":1,"ts":1,"source":"p","transfer_id":"t"}\n',
         2, "expected"),
        (b'{"format":"kvledger","version":1}\n{"kind":"seal","seq":1,"ts":1,"source":"p","transfer_id":"t","expected":1}\n{"kind":"se',
         3, "truncated last line"),
        (b'{"format":"kvledger","version":1}\n{"kind":"seal","seq":1,"ts":1,"source":"p","transfer_id":"t","expected":18446744073709551616}\n',
         2, "field 'expected': integer 18446744073709551616 does not fit in 64 bits"),
        (b'{"format":"kvledger","version":1}\n{"kind":"seal","seq":1,"ts":900000000000.0,"source":"p","transfer_id":"t","expected":1}\n',
         2, "field 'ts': must be seconds since the epoch"),
        (b'{"format":"kvledger","version":1}\n{"kind":"seal","seq":1,"ts":1,"source":"p\\u0000","transfer_id":"t","expected":1}\n',
         2, "field 'source': must not contain NUL"),
        (b'{"format":"kvledger","version":1,"meta":{"x":' + b"[" * 1000 + b"]" * 1000 + b"}}\n", 1, "nested too deep"),
    ],
)  # fmt: skip
def test_bad_logs_name_the_line_and_field(tmp_path: Path, content: bytes, line: int, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(LogFormatError) as info:
        list(read_events(path))
    assert info.value.line == line
    assert needle in str(info.value) and str(path) in str(info.value)


def test_skip_bad_lines_reports_what_it_skipped(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    with LogWriter(path) as writer:
        writer.write_many(_sample()[:2])
    with path.open("ab") as f:
        f.write(b"garbage\n")
    with LogWriter(path) as writer:
        writer.write(_sample()[2])
    from kvledger.ledger.jsonl import open_log

    reader = open_log(path, skip_bad_lines=True)
    assert [e.seq for e in reader] == [1, 2, 3]
    assert [line for line, _ in reader.skipped] == [4]


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(read_events(tmp_path / "nope.jsonl"))


def test_merge_orders_by_time_keeps_each_source_in_order_and_refuses_overlap() -> None:
    p, c = Side("p", start_ts=10.0), Side("c", start_ts=10.005)
    left = [p.ack("t", "release"), p.ack("t", "release"), p.ack("t", "release")]
    right = [c.ack("t", "recv"), c.ack("t", "recv")]
    merged = list(merge([left, right]))
    assert [(e.source, e.seq) for e in merged] == [("p", 1), ("c", 1), ("p", 2), ("c", 2), ("p", 3)]
    with pytest.raises(OverlapError, match=r"appears in both a\.jsonl and b\.jsonl"):
        list(merge([left, left], names=["a.jsonl", "b.jsonl"]))


def test_the_header_nesting_bound_does_not_depend_on_the_callers_stack(tmp_path: Path) -> None:
    """The bound is counted before decoding: once, a header nested ~950 deep decoded in a shallow thread
    (the service) and raised RecursionError in a deeper one (a test), as the fuzz found."""
    path = tmp_path / "deep.jsonl"

    def header(depth: int) -> bytes:
        meta = b"[" * (depth - 2) + b'"]]"' + b"]" * (depth - 2)  # brackets in a string do not count
        return b'{"format":"kvledger","version":1,"meta":{"x":' + meta + b"}}\n"

    path.write_bytes(header(JSONL_HEADER_DEPTH_MAX))
    assert list(read_events(path)) == []
    path.write_bytes(header(JSONL_HEADER_DEPTH_MAX + 1))
    with pytest.raises(LogFormatError, match="nested too deep"):
        list(read_events(path))
