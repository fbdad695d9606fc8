"""The soak: hours of simulated P/D traffic through kvledger's connector pair, under the storm's faults and those
of long runs (preemption and re-asks, recompute after failed loads, reused transfer ids, engines that die and
come back from their store). Prints each soak's account, then one JSON line.

Run:
    python benchmarks/soak.py                   # 6 simulated hours, READ and WRITE, seed 1
    python benchmarks/soak.py --hours 24 --mode write --seed 7
    python benchmarks/soak.py --log /tmp/soak.jsonl   # keep each soak's merged incident log
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file, this file's folder comes first on sys.path and `connector.py` there would shadow the package.
_here = Path(__file__).resolve().parent
sys.path[:] = [str(_here.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

from benchmarks.quick import parse_args  # noqa: E402
from kvledger.connector.sim.config import FaultKind  # noqa: E402
from kvledger.connector.sim.report import soak_account, soak_figures  # noqa: E402
from kvledger.connector.sim.soak_config import (  # noqa: E402
    SOAK_FAULT_KINDS,
    STORM_KINDS_IN_SOAK,
    SoakConfig,
    SoakFaultKind,
    SoakResult,
)
from kvledger.connector.sim.storm import run_soak  # noqa: E402
from kvledger.ledger.events import Mode  # noqa: E402

FIELDS: tuple[str, ...] = (
    "sim_hours",
    "soaks",
    "modes",
    "seeds",
    "requests",
    "events",
    "reasks",
    "recomputes",
    "loaded_twice",
    "id_reuses",
    "id_reuses_refused",
    "reuses_across_restart",
    "restarts",
    "leaked_blocks",
    "double_releases",
    "premature_releases",
    "hung_requests",
    "corrupt_receives",
    "replay_matches",
    "compaction_invariant",
    "peak_tracked_sides",
    "tracked_sides_bound",
    "peak_tracked_sides_per_ledger",
    "tracked_sides_bound_per_ledger",
    "tombstone_generations",
    "failed_soaks",
    "wall_seconds",
    "bench_wall_seconds",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def _kinds(text: str, known: tuple[str, ...], everything: tuple[str, ...]) -> frozenset[str]:
    if text == "all":
        return frozenset(everything)
    if text == "none":
        return frozenset()
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    unknown = sorted(kinds - set(known))
    if unknown:
        raise SystemExit(f"unknown fault kinds {unknown}; known: {known}")
    return frozenset(kinds)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=["read", "write", "both"], default="both")
    parser.add_argument("--hours", type=float, default=SoakConfig.sim_hours, help="simulated hours of arrivals")
    parser.add_argument("--faults", default="all", help=f"the storm's kinds, comma-separated, 'all' or 'none': "
                        f"{STORM_KINDS_IN_SOAK}")  # fmt: skip
    parser.add_argument("--soak-faults", default="all", help=f"comma-separated, 'all' or 'none': {SOAK_FAULT_KINDS}")
    parser.add_argument("--fault-rate", type=float, default=SoakConfig.fault_rate)
    parser.add_argument("--tombstones-max", type=int, default=SoakConfig.tombstones_max)
    parser.add_argument("--log", type=Path, help="write each soak's merged JSONL incident log (suffixed by mode)")
    parser.add_argument("--ledger-url", help="persist to this (fresh) store instead of a temporary SQLite file")
    return parse_args(parser, hours=0.1)


def main() -> int:
    args = _parse()
    faults: frozenset[FaultKind] = _kinds(args.faults, STORM_KINDS_IN_SOAK, STORM_KINDS_IN_SOAK)  # type: ignore[assignment]
    soak_faults: frozenset[SoakFaultKind] = _kinds(args.soak_faults, SOAK_FAULT_KINDS, SOAK_FAULT_KINDS)  # type: ignore[assignment]
    base = SoakConfig(
        seed=args.seed,
        sim_hours=args.hours,
        faults=faults,
        soak_faults=soak_faults,
        fault_rate=args.fault_rate,
        tombstones_max=args.tombstones_max,
        ledger_url=args.ledger_url,
    )
    modes: list[Mode] = ["read", "write"] if args.mode == "both" else [args.mode]
    if args.ledger_url and len(modes) > 1:
        raise SystemExit("--ledger-url takes one soak's events: give --mode read or --mode write")
    results: list[SoakResult] = []
    started = time.perf_counter()
    for mode in modes:
        log = args.log.with_name(f"{args.log.stem}-{mode}{args.log.suffix or '.jsonl'}") if args.log else None
        result = run_soak(replace(base, mode=mode, incident_log=log))
        results.append(result)
        print("\n".join(soak_account(result)), flush=True)
    figures = soak_figures(results)
    figures["bench_wall_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
