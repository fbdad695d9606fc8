"""Instructions per event of append+fold, compiled and interpreted, against the plain-dict baseline of
benchmarks/fold.py, counted by valgrind's callgrind on the same synthetic events.

Run: python benchmarks/instructions.py [--events N] (needs valgrind; its five children run at once). Ends with one
JSON line.

Why beside benchmarks/fold.py: on these shared 2-core machines a neighbour's load moves CPU time by tens
of percent from one minute to the next, while the instructions a run executes do not move at all, so a
change of a few percent shows here and nowhere else. Instructions are not time (a cache miss costs many),
so the timed ratio stays the figure of record; this one says whether a change did less work. Each count is
a whole process's (interpreter start, generating the events) minus the same process run without the
measured part, divided by the events measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fold import run_baseline, run_ledger, traffic
from benchmarks.quick import parse_args
from kvledger.ledger.compiled import INTERPRETED_ENV, compiled

REPEATS = 2
"""Runs of the measured part per process (the difference to the process without it is divided by these)."""
SEED = 7


FIELDS: tuple[str, ...] = (
    "events",
    "compiled",
    "instructions_per_event",
    "instructions_per_event_interpreted",
    "baseline_instructions_per_event",
    "instructions_ratio",
    "instructions_ratio_interpreted",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def _child(part: str, events: int) -> None:
    """Generate the events; then run `part` REPEATS times ('none': nothing, the count subtracted)."""
    _, by_source = traffic(events, SEED)
    print(sum(len(e) for e in by_source.values()))
    for _ in range(REPEATS if part != "none" else 0):
        if part == "ledger":
            run_ledger(by_source)
        else:
            run_baseline(by_source)


def _start(part: str, events: int, *, interpreted: bool = False) -> subprocess.Popen[str]:
    """One child under callgrind; the counts do not depend on what else runs, so the children run at once."""
    env = {**os.environ, INTERPRETED_ENV: "1" if interpreted else "0"}
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable]
    command += [__file__, "--child", part, "--events", str(events)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _instructions(child: subprocess.Popen[str]) -> tuple[int, int]:
    """(instructions the whole child executed, events it generated)."""
    out, err = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"a callgrind child failed ({child.returncode}):\n{err[-2000:]}")
    found = re.search(r"Collected : ([\d,]+)", err)
    assert found is not None, err[-2000:]
    return int(found.group(1).replace(",", "")), int(out.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=30_000, help="at least this many events")
    parser.add_argument("--child", choices=("none", "ledger", "baseline"), help=argparse.SUPPRESS)
    args = parse_args(parser, events=500)
    if args.child:
        _child(args.child, args.events)
        return
    parts = [("none", False), ("ledger", False), ("baseline", False), ("none", True), ("ledger", True)]
    children = [_start(part, args.events, interpreted=interpreted) for part, interpreted in parts]
    (zero, n), (ledger, _), (baseline, _), (zero_interpreted, _), (interpreted, _) = map(_instructions, children)
    ledger_ir = (ledger - zero) / (REPEATS * n)
    baseline_ir = (baseline - zero) / (REPEATS * n)
    interpreted_ir = (interpreted - zero_interpreted) / (REPEATS * n)
    figures = {
        "events": n,
        "compiled": compiled(),
        "instructions_per_event": round(ledger_ir),
        "instructions_per_event_interpreted": round(interpreted_ir),
        "baseline_instructions_per_event": round(baseline_ir),
        "instructions_ratio": round(ledger_ir / baseline_ir, 3),
        "instructions_ratio_interpreted": round(interpreted_ir / baseline_ir, 3),
    }
    print(f"append+fold : {figures['instructions_per_event']:>7,} instructions/event")
    print(f"interpreted : {figures['instructions_per_event_interpreted']:>7,} instructions/event")
    print(f"dict books  : {figures['baseline_instructions_per_event']:>7,} instructions/event")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
