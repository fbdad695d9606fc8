"""SIGKILL a process appending through the writer, 100 times: the store keeps a gapless prefix, no torn batch."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from ledger.events import Event
from ledger.fold import fold_all
from ledger.store.base import EventStore
from ledger.store.connect import open_store
from ledger.store.recovery import load_state, open_ledger
from ledger.store.writer import BackgroundWriter
from ledger.synth import SynthConfig, generate

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


def _child(path: Path, spill: Path, marks: Path) -> None:  # pragma: no cover - runs in the child
    fd = os.open(marks, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        store = open_store(str(path))
        sources = sorted({CONFIG.producer, CONFIG.consumer})
        ledgers = {s: open_ledger(store, s, spill_dir=spill, snapshot_tail_events_max=5_000) for s in sources}
        stored = {s: ledgers[s].log.next_seq - 1 for s in sources}
        writer = BackgroundWriter(MarkingStore(store, fd), spill, batch_events_max=200, batch_age_s_max=0.002)
        writer.start()
        for ledger in ledgers.values():
            ledger.log.subscribe(writer.put)
        for i, event in enumerate(STREAM):
            if event.seq > stored[event.source]:
                ledgers[event.source].append(event)
            if i % APPENDS_PER_STEP == 0:
                time.sleep(STEP_PAUSE_S)  # an engine appends in per-step bursts, not in one tight loop
        writer.close()
        os.write(fd, b"DONE\n")
        time.sleep(60)
    except BaseException as error:
        os.write(fd, f"E {error!r}\n".encode())
    os._exit(0)


@pytest.mark.slow
def test_sigkill_leaves_a_gapless_prefix_and_no_torn_batch(tmp_path: Path) -> None:
    if not STREAM:
        STREAM.extend(generate(CONFIG, seed=SEED))
        INDEX.update({(e.source, e.seq): i for i, e in enumerate(STREAM)})
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
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        lines = marks.read_text().splitlines()
        assert not [line for line in lines if line.startswith("E ")], (
            f"kill {kill} (seed {SEED}): child failed: {lines}"
        )
        ends_tried = {int(line[2:]) for line in lines if line.startswith("A ")}
        ends_done = {int(line[2:]) for line in lines if line.startswith("C ")}
        attempted += len(ends_tried)
        mid_batch += len(ends_tried - ends_done)
        # What the store holds now, read on from where the last check stopped.
        while batch := store.tail(cursor, limit=10_000):
            events = [event for _, event in batch]
            assert events == STREAM[prefix : prefix + len(events)], f"kill {kill} (seed {SEED}): not a prefix"
            prefix += len(events)
            cursor = batch[-1][0]
        assert store.count() == prefix, f"kill {kill}: rows beyond the checked prefix"
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
