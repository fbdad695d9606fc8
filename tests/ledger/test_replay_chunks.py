"""Replay folds a log in decoded chunks: its decisions never depend on where the chunks fall."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvledger.ledger.jsonl as jsonl_module
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import LogFormatError, read_chunks, read_events, write_log
from kvledger.ledger.merge import batched
from kvledger.ledger.replay import ReplayResult, replay_chunks
from kvledger.ledger.summary import summarize
from kvledger.ledger.synth import SynthConfig, generate

CFG = SynthConfig(transfers=600, concurrency=64, layers=16, layers_per_step=4, fault_rate=0.1)


def _outcome(result: ReplayResult, *, whole_state: bool) -> tuple[object, ...]:
    decisions = [(r.source, r.transfer_id, r.cause, r.seq) for r in result.releases]
    seen = (result.events, result.first_ts, result.last_ts, result.stopped_early, result.latencies.completed.counts)
    if not whole_state:
        return decisions, seen
    now = result.last_ts or 0.0
    return decisions, seen, summarize(result.state, audit(result.state, now))


@pytest.mark.parametrize("chunk_bytes", [300, 4096, 1 << 20])
def test_chunked_replay_equals_replay_one_event_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    path = tmp_path / "log.jsonl"
    events = list(generate(CFG, seed=5))
    write_log(path, events)
    monkeypatch.setattr(jsonl_module, "JSONL_CHUNK_BYTES", chunk_bytes)
    chunks = list(read_chunks(path))
    assert [e for chunk in chunks for e in chunk] == events
    until_ts = events[len(events) // 2].ts
    for kwargs in ({}, {"until_ts": until_ts}, {"until_seq": 500}):
        for compact_every in (None, 64):
            # With compaction (64: many times over), which sides are forgotten when follows the
            # chunks; decisions never do. Without it, the whole state is the same.
            by_chunks = replay_chunks(read_chunks(path), compact_every=compact_every, **kwargs)  # type: ignore[arg-type]
            one_by_one = replay_chunks(batched(events, 1), compact_every=compact_every, **kwargs)  # type: ignore[arg-type]
            whole = compact_every is None
            assert _outcome(by_chunks, whole_state=whole) == _outcome(one_by_one, whole_state=whole)
    assert replay_chunks(read_chunks(path), until_ts=until_ts).stopped_early


def test_a_bad_line_inside_a_chunk_is_named_and_nothing_of_its_chunk_is_folded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "log.jsonl"
    write_log(path, list(generate(CFG, seed=6))[:40])
    lines = path.read_bytes().splitlines(keepends=True)
    lines[30] = b'{"kind":"ack","seq":30,"ts":"soon"}\n'
    path.write_bytes(b"".join(lines))
    monkeypatch.setattr(jsonl_module, "JSONL_CHUNK_BYTES", 1 << 20)
    with pytest.raises(LogFormatError) as caught:
        list(read_chunks(path))
    assert caught.value.line == 31
    # The per-event reader names the same line.
    with pytest.raises(LogFormatError) as again:
        list(read_events(path))
    assert again.value.line == 31


def test_a_replay_leaves_the_collector_as_it_found_it() -> None:
    """The collector is paused while a replay folds (it would free nothing), and only then."""
    events = list(generate(CFG, seed=7))[:200]

    def failing() -> Iterator[list[Event]]:
        yield events[:100]
        raise OSError("the disk went away")

    assert gc.isenabled()
    seen: list[bool] = []
    replay_chunks(batched(events, 50), on_progress=lambda n: seen.append(gc.isenabled()))
    assert seen == [False] * 4 and gc.isenabled()
    with pytest.raises(OSError, match="went away"):
        replay_chunks(failing())
    assert gc.isenabled()
    gc.disable()
    try:
        replay_chunks(batched(events, 50))
        assert not gc.isenabled()  # a caller's own pause is kept
    finally:
        gc.enable()
