"""Append + fold throughput of the ledger against plain-dict bookkeeping making the same decisions.

Run: python -m benchmarks.fold [--events N]. Ends with one JSON line of figures.

`compiled` says whether the fold measured is the compiled one (ledger/compiled.py); beside it,
`events_per_s_interpreted` is the same append+fold of the same events by the same source files run
interpreted (`KVLEDGER_INTERPRETED=1`), in a worker process whose runs interleave with these. Times are
CPU time (`time.process_time`), best of REPEATS: the machines are shared, and a neighbour's load stretches
wall time, not the CPU time a run takes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterable
from pathlib import Path

import kvledger.ledger as ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

from benchmarks.quick import parse_args
from kvledger.ledger.compiled import INTERPRETED_ENV, compiled
from kvledger.ledger.events import Ack, Event, Expire, Fail, Map, Schedule, Seal
from kvledger.ledger.fold import LedgerState
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.synth import SynthConfig, generate

BATCH = 64
"""Events a worker appends at once (buffered during the forward, appended at wait_for_save)."""
REPEATS = 5
"""Interleaved runs of each; the best of each is kept (these machines are noisy)."""
RETAIN_S = 60.0
"""Decided sides kept this long (log time) before the ledger forgets them, as in the connector."""


FIELDS: tuple[str, ...] = (
    "events",
    "transfers",
    "compiled",
    "events_per_s",
    "events_per_s_interpreted",
    "baseline_events_per_s",
    "ratio",
    "events_per_s_with_upkeep",
    "ratio_with_upkeep",
    "same_decisions",
    "releases",
    "bytes_per_live_transfer",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


class DictBookkeeping:
    """The baseline: MoRIIO-style dicts keyed by transfer id, no log, same release rule."""

    def __init__(self) -> None:
        self.maps: dict[tuple[str, str], Map] = {}
        self.scheduled: dict[tuple[str, str], set[int]] = {}
        self.acked: dict[tuple[str, str], set[int]] = {}
        self.expected: dict[tuple[str, str], int] = {}
        self.ranks: dict[tuple[str, str], set[int]] = {}
        self.recv: set[tuple[str, str]] = set()
        self.failed: set[tuple[str, str]] = set()
        self.done: set[tuple[str, str]] = set()
        self.releases: list[tuple[str, str, str]] = []

    def feed(self, e: Event) -> None:
        key = (e.source, e.transfer_id)
        if key in self.done:
            return
        if isinstance(e, Ack):
            if e.what == "release":
                self.ranks.setdefault(key, set()).add(e.rank)
            elif e.what == "recv" or e.layers is None:
                self.recv.add(key)
            else:
                sched = self.scheduled.get(key, ())
                self.acked.setdefault(key, set()).update(x for x in e.layers if x in sched)
        elif isinstance(e, Schedule):
            if e.layers is not None:
                self.scheduled.setdefault(key, set()).update(e.layers)
            return
        elif isinstance(e, Map):
            self.maps[key] = e
            if key in self.failed:
                self._release(key, "failed")
                return
        elif isinstance(e, Seal):
            self.expected[key] = e.expected
        elif isinstance(e, Fail):
            if not e.retryable:
                if key in self.maps:
                    self._release(key, "failed")
                else:
                    self.failed.add(key)
            return
        elif isinstance(e, Expire):
            if key in self.maps:
                self._release(key, "expired")
            return
        m = self.maps.get(key)
        if m is None:
            return
        if m.role == "producer":
            if m.mode == "read":
                done = len(self.ranks.get(key, ())) >= m.acks_expected
            else:
                exp = self.expected.get(key)
                done = (exp is not None and len(self.acked.get(key, ())) >= exp) or len(
                    self.ranks.get(key, ())
                ) >= m.acks_expected
        else:
            done = key in self.recv
        if done:
            self._release(key, "completed")

    def _release(self, key: tuple[str, str], cause: str) -> None:
        self.done.add(key)
        self.releases.append((key[0], key[1], cause))
        for table in (self.scheduled, self.acked, self.expected, self.ranks):
            table.pop(key, None)


def _batches(events: list[Event]) -> Iterable[list[Event]]:
    for i in range(0, len(events), BATCH):
        yield events[i : i + BATCH]


def run_ledger(by_source: dict[str, list[Event]], *, upkeep: bool = False) -> tuple[float, list[tuple[str, str, str]]]:
    """Append + fold every batch; with `upkeep`, also the running ledger's `maintain` after each one
    (what the connector's tick does every step: forget sides decided more than RETAIN_S ago)."""
    ledgers = {source: Ledger(source) for source in by_source}
    gc.collect()
    start = time.process_time()
    for source, events in by_source.items():
        ledger = ledgers[source]
        extend, maintain = ledger.extend, ledger.maintain
        if upkeep:
            for batch in _batches(events):
                extend(batch)
                maintain(batch[-1].ts, retain_s=RETAIN_S)
        else:
            for batch in _batches(events):
                extend(batch)
    elapsed = time.process_time() - start
    releases = [(r.source, str(r.transfer_id), str(r.cause)) for lg in ledgers.values() for r in lg.take_releases()]
    return elapsed, releases


def run_baseline(by_source: dict[str, list[Event]]) -> tuple[float, list[tuple[str, str, str]]]:
    books = {source: DictBookkeeping() for source in by_source}
    gc.collect()
    start = time.process_time()
    for source, events in by_source.items():
        feed = books[source].feed
        for batch in _batches(events):
            for event in batch:
                feed(event)
    elapsed = time.process_time() - start
    return elapsed, [r for book in books.values() for r in book.releases]


def bytes_per_live_transfer(n: int = 20_000) -> float:
    """Memory of `n` mapped, undecided sides (with write layers scheduled) divided by `n`."""
    cfg = SynthConfig(transfers=n, concurrency=n, layers=32, layers_per_step=32)
    events = [e for e in generate(cfg, seed=3) if isinstance(e, (Map, Schedule))]
    tracemalloc.start()
    state = LedgerState()
    before = tracemalloc.get_traced_memory()[0]
    for event in events:
        state.apply(event)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(state.live) == 2 * n
    return (after - before) / len(state.live)


def traffic(events: int, seed: int) -> tuple[SynthConfig, dict[str, list[Event]]]:
    cfg = SynthConfig(transfers=max(1, events // 12), concurrency=512, layers=64, layers_per_step=8, fault_rate=0.05)
    by_source: dict[str, list[Event]] = {}
    for event in generate(cfg, seed=seed):
        by_source.setdefault(event.source, []).append(event)
    return cfg, by_source


def _digest(releases: list[tuple[str, str, str]]) -> str:
    return hashlib.sha256(json.dumps(sorted(releases)).encode()).hexdigest()


def serve_runs(events: int, seed: int) -> None:
    """The interpreted worker: one append+fold run per line read, its CPU time and releases written back."""
    _, by_source = traffic(events, seed)
    print(json.dumps({"compiled": compiled()}), flush=True)
    for _ in sys.stdin:
        elapsed, releases = run_ledger(by_source)
        print(json.dumps({"elapsed": elapsed, "releases": _digest(releases)}), flush=True)


def interpreted_worker(events: int, seed: int) -> subprocess.Popen[str]:
    """This file, run with the fold's sources interpreted, on the same events (same config and seed)."""
    root = Path(ledger.__file__).resolve().parent.parent  # the tree this run imports, wherever it is
    env = {
        **os.environ,
        INTERPRETED_ENV: "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, __file__, "--events", str(events), "--seed", str(seed), "--serve-interpreted"]
    worker = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    hello = json.loads(worker.stdout.readline())
    assert hello["compiled"] is False, "the worker runs the fold interpreted"
    return worker


def _worker_run(worker: subprocess.Popen[str]) -> tuple[float, str]:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write("run\n")
    worker.stdin.flush()
    answer = json.loads(worker.stdout.readline())
    return float(answer["elapsed"]), str(answer["releases"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000, help="at least this many events")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--serve-interpreted", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(parser, events=3_000)
    if args.serve_interpreted:
        serve_runs(args.events, args.seed)
        return
    is_compiled = compiled()
    worker = interpreted_worker(args.events, args.seed) if is_compiled else None
    cfg, by_source = traffic(args.events, args.seed)
    n = sum(len(events) for events in by_source.values())
    # Interleave runs so machine noise hits all alike; keep the best of each.
    ledger_s, upkeep_s, baseline_s, interpreted_s = float("inf"), float("inf"), float("inf"), float("inf")
    interpreted_releases = ""
    for _ in range(REPEATS):
        elapsed, ledger_releases = run_ledger(by_source)
        ledger_s = min(ledger_s, elapsed)
        if worker is not None:
            elapsed, interpreted_releases = _worker_run(worker)
            interpreted_s = min(interpreted_s, elapsed)
        elapsed, upkeep_releases = run_ledger(by_source, upkeep=True)
        upkeep_s = min(upkeep_s, elapsed)
        elapsed, baseline_releases = run_baseline(by_source)
        baseline_s = min(baseline_s, elapsed)
    if worker is None:
        interpreted_s, interpreted_releases = ledger_s, _digest(ledger_releases)  # what ran is interpreted
    else:
        worker.communicate()
    same = sorted(ledger_releases) == sorted(baseline_releases) == sorted(upkeep_releases)
    same = same and interpreted_releases == _digest(ledger_releases)
    figures = {
        "events": n,
        "transfers": cfg.transfers,
        "compiled": is_compiled,
        "events_per_s": round(n / ledger_s),
        "events_per_s_interpreted": round(n / interpreted_s),
        "baseline_events_per_s": round(n / baseline_s),
        "ratio": round(ledger_s / baseline_s, 3),
        "events_per_s_with_upkeep": round(n / upkeep_s),
        "ratio_with_upkeep": round(upkeep_s / baseline_s, 3),
        "same_decisions": same,
        "releases": len(ledger_releases),
        "bytes_per_live_transfer": round(bytes_per_live_transfer()),
    }
    build = "compiled" if is_compiled else "interpreted (nothing compiled here)"
    print(f"ledger   append+fold: {figures['events_per_s']:>12,} events/s ({build})")
    print(f"same, interpreted   : {figures['events_per_s_interpreted']:>12,} events/s")
    print(f"baseline dict books : {figures['baseline_events_per_s']:>12,} events/s")
    print(f"ratio (ledger time / baseline time): {figures['ratio']}  same decisions: {same}")
    print(
        f"with upkeep (forgetting sides decided {RETAIN_S:g} s ago, as a running connector does; the "
        f"baseline never forgets): {figures['events_per_s_with_upkeep']:,} events/s, "
        f"ratio {figures['ratio_with_upkeep']}"
    )
    print(f"memory per live transfer side: {figures['bytes_per_live_transfer']} bytes")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
