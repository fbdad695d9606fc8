"""SIGKILL a process appending through the writer: the store keeps a gapless prefix, no torn batch; and
killed while spilling (the store down half the time), every durable spilled event is loaded exactly once."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvledger.ledger.events import Event
from kvledger.ledger.fold import fold_all
from kvledger.ledger.jsonl import LogReader
from kvledger.ledger.log import EventLog
from kvledger.ledger.store.base import EventStore, StoreUnavailable
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.recovery import drain_spill, load_state, open_ledger
from kvledger.ledger.store.writer import SPILL_GLOB, BackgroundWriter
from kvledger.ledger.synth import SynthConfig, generate

KILLS = 100
SEED = 20240501
APPENDS_PER_STEP = 256
STEP_PAUSE_S = 0.0005
"""Between bursts of appends, as between vLLM steps: the writer thread gets the GIL to commit."""
CONFIG = SynthConfig(transfers=15_000, concurrency=64, fault_rate=0.1)
STREAM: list[Event] = []
INDEX: dict[tuple[str, int], int] = {}


class MarkingStore:
    """Writes `A end` before and `C end` after each batch (end = stream prefix length after it)."""

    def __init__(self, inner: EventStore, fd: int) -> None:
        self.inner, self.fd, self.url = inner, fd, inner.url

    def append(self, events: Sequence[Event]) -> int:
        end = INDEX[(events[-1].source, events[-1].seq)] + 1
        os.write(self.fd, b"A %d\n" % end)
        inserted = self.inner.append(events)
        os.write(self.fd, b"C %d\n" % end)
        return inserted

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class StallingStore(MarkingStore):
    """Unreachable for `DOWN_S` of every `PERIOD_S` (by the clock): the writer spills, then loads back."""

    PERIOD_S, DOWN_S = 0.08, 0.05

    def append(self, events: Sequence[Event]) -> int:
        if time.monotonic() % self.PERIOD_S < self.DOWN_S:
            raise StoreUnavailable(f"{self.url}: down for the test")
        return super().append(events)


def _child(path: Path, spill: Path, marks: Path, stalling: bool = False) -> None:  # pragma: no cover - the child
    fd = os.open(marks, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        store = open_store(str(path))
        sources = sorted({CONFIG.producer, CONFIG.consumer})
        logs: dict[str, EventLog] = {}
        appends: dict[str, Callable[[Event], object]] = {}
        if stalling:
            # The parent loaded the spill already and checks recovery itself: the logs only need their seqs.
            stored = {s: store.sources().get(s, 0) for s in sources}
            logs = {s: EventLog(s, next_seq=stored[s] + 1) for s in sources}
            appends = {s: log.append for s, log in logs.items()}
            writer = BackgroundWriter(StallingStore(store, fd), spill, queue_events_max=300, batch_events_max=100)
        else:
            ledgers = {s: open_ledger(store, s, spill_dir=spill, snapshot_tail_events_max=5_000) for s in sources}
            stored = {s: ledgers[s].log.next_seq - 1 for s in sources}
            logs = {s: ledger.log for s, ledger in ledgers.items()}
            appends = {s: ledger.append for s, ledger in ledgers.items()}
            writer = BackgroundWriter(MarkingStore(store, fd), spill, batch_events_max=200, batch_age_s_max=0.002)
        writer.start()
        for log in logs.values():
            log.subscribe(writer.put)
        os.write(fd, b"S\n")  # recovered: appending from here on
        for i, event in enumerate(STREAM):
            if event.seq > stored[event.source]:
                appends[event.source](event)
            if i % APPENDS_PER_STEP == 0:
                time.sleep(STEP_PAUSE_S)  # an engine appends in per-step bursts, not in one tight loop
        writer.close()
        os.write(fd, b"DONE\n")
        time.sleep(60)
    except BaseException as error:
        os.write(fd, f"E {error!r}\n".encode())
    os._exit(0)


def _kill(pid: int, marks: Path, kill: int) -> list[str]:
    """SIGKILL the child; the lines it marked, having checked that it did not fail on its own."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    lines = marks.read_text().splitlines()
    assert not [line for line in lines if line.startswith("E ")], f"kill {kill} (seed {SEED}): child failed: {lines}"
    return lines


def _checked_prefix(store: EventStore, prefix: int, cursor: int, kill: int) -> tuple[int, int]:
    """Read on from where the last check stopped: the store must hold exactly a prefix of the stream
    (no hole, no duplicate). Returns the new prefix length and cursor."""
    while batch := store.tail(cursor, limit=10_000):
        events = [event for _, event in batch]
        assert events == STREAM[prefix : prefix + len(events)], f"kill {kill} (seed {SEED}): not a prefix"
        prefix += len(events)
        cursor = batch[-1][0]
    assert store.count() == prefix, f"kill {kill}: rows beyond the checked prefix"
    return prefix, cursor


def _stream() -> None:
    if not STREAM:
        STREAM.extend(generate(CONFIG, seed=SEED))
        INDEX.update({(e.source, e.seq): i for i, e in enumerate(STREAM)})


@pytest.mark.slow
def test_sigkill_leaves_a_gapless_prefix_and_no_torn_batch(tmp_path: Path) -> None:
    _stream()
    path, spill, marks = tmp_path / "ledger.db", tmp_path / "spill", tmp_path / "marks"
    open_store(str(path), create=True).close()
    rng = random.Random(SEED)
    store = open_store(str(path))
    prefix, cursor, mid_batch, attempted, started = 0, 0, 0, 0, time.monotonic()
    for kill in range(KILLS):
        before = prefix
        pid = os.fork()
        if pid == 0:  # pragma: no cover
            _child(path, spill, marks)
        time.sleep(rng.uniform(0.01, 0.25))
        lines = _kill(pid, marks, kill)
        ends_tried = {int(line[2:]) for line in lines if line.startswith("A ")}
        ends_done = {int(line[2:]) for line in lines if line.startswith("C ")}
        attempted += len(ends_tried)
        mid_batch += len(ends_tried - ends_done)
        prefix, cursor = _checked_prefix(store, prefix, cursor, kill)
        # Whole batches only: the prefix ends where a batch ended, at or after every committed one.
        assert prefix == before or prefix in ends_tried, f"kill {kill} (seed {SEED}): torn batch at {prefix}"
        assert prefix >= max(ends_done, default=0), f"kill {kill} (seed {SEED}): a committed batch is missing"
        for source, last_seq in store.sources().items():
            recovered = load_state(store, source)  # snapshot + tail; raises on a gap
            assert recovered.last_seq == last_seq
            if kill % 20 == 19 or kill == KILLS - 1:
                full, _ = fold_all(e for e in STREAM[:prefix] if e.source == source)
                assert {k: t.snapshot() for k, t in recovered.state.transfers.items()} == {
                    k: t.snapshot() for k, t in full.transfers.items()
                }, f"kill {kill} (seed {SEED}): refold differs"
    store.close()
    print(
        f"\ncrash test: {KILLS} SIGKILLs (seed {SEED}) in {time.monotonic() - started:.1f}s; "
        f"{prefix} of {len(STREAM)} events stored as a gapless prefix; {attempted} batches attempted, "
        f"{mid_batch} killed mid-batch, none torn"
    )
    assert prefix > 0


SPILL_KILLS = 30
START_POLLS_MAX = 6_000
"""Polls (5 ms apart) for a child to finish recovering: a bound, not a timing claim."""


def _durable_spilled(spill: Path) -> list[int]:
    """Stream positions of the events in the spill files now on disk (a torn last line is not durable)."""
    found = []
    for path in sorted(spill.glob(SPILL_GLOB)):
        with open(path, "rb") as stream:
            if b"\n" not in stream.read(4096):
                continue  # killed before its header was flushed: holds nothing
            stream.seek(0)
            found += [INDEX[(e.source, e.seq)] for e in LogReader(stream, str(path), skip_bad_lines=True)]
    return found


@pytest.mark.slow
def test_sigkill_while_spilling_loads_every_durable_spilled_event_once(tmp_path: Path) -> None:
    """Kills taken while the store is down half the time, so the writer spills and loads back over and over.
    Once, queued events died with the process while the newer spill survived, and recovery set that spill
    aside (39% of spilled events in one run). Now what is durable is a gapless prefix of what was put."""
    _stream()
    path, spill, marks = tmp_path / "ledger.db", tmp_path / "spill", tmp_path / "marks"
    open_store(str(path), create=True).close()
    rng = random.Random(SEED + 1)
    store = open_store(str(path))
    prefix, cursor, kills_while_spilling, spilled_loaded, started = 0, 0, 0, 0, time.monotonic()
    for kill in range(SPILL_KILLS):
        marks.unlink(missing_ok=True)
        pid = os.fork()
        if pid == 0:  # pragma: no cover
            _child(path, spill, marks, stalling=True)
        for _ in range(START_POLLS_MAX):  # kill while appending, not while the child is still recovering
            if marks.exists() and marks.read_bytes().startswith(b"S\n"):
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))
        _kill(pid, marks, kill)
        durable = _durable_spilled(spill)
        kills_while_spilling += bool(durable)
        drain_spill(store, spill)  # what the next start does first
        assert not [p.name for p in spill.iterdir() if p.name != "rejected.jsonl"], f"kill {kill}: files left"
        prefix, cursor = _checked_prefix(store, prefix, cursor, kill)
        # Every spilled event that was durable at the kill is in the store now: nothing set aside, no hole.
        assert prefix > max(durable, default=-1), f"kill {kill} (seed {SEED}): a durable spilled event is missing"
        spilled_loaded += len(durable)
        if kill % 10 == 9:  # a refold is the slow part: the prefix check above already excludes holes
            for source in store.sources():
                assert load_state(store, source).gaps == [], f"kill {kill} (seed {SEED}): {source} has a gap"
    store.close()
    print(
        f"\ncrash test while spilling: {SPILL_KILLS} SIGKILLs (seed {SEED + 1}) in {time.monotonic() - started:.1f}s, "
        f"{kills_while_spilling} with spill files on disk ({spilled_loaded} durable spilled events, all loaded); "
        f"{prefix} of {len(STREAM)} events stored as a gapless prefix"
    )
    assert kills_while_spilling > 0  # the kills did land while spilling: the test tested what it says
