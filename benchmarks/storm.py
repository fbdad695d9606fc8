"""The P/D fault storm: kvledger's connector pair under every fault kind, next to naive bookkeeping fed the
same observations. Prints the side-by-side table, then one JSON line.

Run:
    python benchmarks/storm.py                  # 2,000 requests at concurrency 512, READ and WRITE, seed 1
    python benchmarks/storm.py --seed 17        # one seed, everything it found (replay a failing seed)
    python benchmarks/storm.py --seeds 1-200    # many seeds (smaller storms); prints each seed that fails

Beside the storms with every protection on, a full run (not --seeds) runs three more per mode with the same
requests, all without peer_death (a dead producer fails every late read, which would hide what they are
about): every protection on (`no_death_*`: the leases at work), leases off (late readers must then be
refused: `leases_off_late_reads_refused`, `leases_off_corrupt_receives` 0) and the negative control, every
protection off (no leases, reads of released blocks served, as before leases): `naive_corrupt_receives` and
`naive_premature_releases` must be above 0, or the storm could not see the failure it guards against.
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
from kvledger.connector.sim.config import FAULT_KINDS, FaultKind, StormConfig, StormResult  # noqa: E402
from kvledger.connector.sim.errors import SimulationError  # noqa: E402
from kvledger.connector.sim.report import account, figures, side_by_side  # noqa: E402
from kvledger.connector.sim.storm import run_storm  # noqa: E402
from kvledger.ledger.events import Mode  # noqa: E402

FULL_REQUESTS = 2000
FULL_CONCURRENCY = 512
SEEDS_REQUESTS = 1000
SEEDS_CONCURRENCY = 256
"""Per seed in a --seeds sweep: smaller storms, so that 200 seeds x 2 modes take a few minutes."""


FIELDS: tuple[str, ...] = (
    "requests",
    "concurrency",
    "modes",
    "seeds",
    "storms",
    "leaked_blocks",
    "double_releases",
    "premature_releases",
    "hung_requests",
    "integrity_failures",
    "failed_reported_as_received",
    "corrupt_receives",
    "late_reads",
    "late_reads_refused",
    "lease_renewals",
    "lease_expiries",
    "late_event_findings",
    "replay_matches",
    "forged_sent",
    "forged_messages_accepted",
    "hook_us_max",
    "naive_leaked_blocks",
    "naive_hung_requests",
    "failed_storms",
    "wall_seconds",
    "sim_requests_per_s",
    "no_death_late_reads",
    "no_death_lease_renewals",
    "no_death_lease_expiries",
    "no_death_corrupt_receives",
    "no_death_premature_releases",
    "no_death_failed_storms",
    "leases_off_late_reads",
    "leases_off_late_reads_refused",
    "leases_off_corrupt_receives",
    "leases_off_premature_releases",
    "naive_late_reads",
    "naive_corrupt_receives",
    "naive_premature_releases",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def _seed_range(text: str) -> list[int]:
    first, _, last = text.partition("-")
    low, high = int(first), int(last or first)
    if high < low:
        raise argparse.ArgumentTypeError(f"empty seed range {text!r}")
    return list(range(low, high + 1))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--seed", type=int, help="run this one seed and print everything")
    group.add_argument("--seeds", type=_seed_range, help="a range such as 1-200: print every seed that fails")
    parser.add_argument("--requests", type=int, help="requests per storm")
    parser.add_argument("--concurrency", type=int, help="requests in flight")
    parser.add_argument("--mode", choices=["read", "write", "both"], default="both")
    parser.add_argument("--faults", default="all", help=f"comma-separated kinds, 'all' or 'none': {FAULT_KINDS}")
    parser.add_argument("--fault-rate", type=float, default=StormConfig.fault_rate)
    parser.add_argument(
        "--load-before-forward", action="store_true", help="step workers in the older order (start_load_kv first)"
    )
    parser.add_argument("--no-control", action="store_true", help="skip the leases-off and negative-control runs")
    parser.add_argument("--log", type=Path, help="write each storm's merged JSONL incident log (suffixed by mode)")
    parser.add_argument("--ledger-url", help="persist each storm's ledgers to this (fresh) store")
    return parse_args(parser, requests=120, concurrency=32)


def _faults(text: str) -> frozenset[FaultKind]:
    if text == "all":
        return frozenset(FAULT_KINDS)
    if text == "none":
        return frozenset()
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise SystemExit(f"unknown fault kinds {unknown}; known: {FAULT_KINDS}")
    return frozenset(k for k in FAULT_KINDS if k in kinds)


def _storm(base: StormConfig, seed: int, mode: Mode, log: Path | None) -> StormResult:
    path = log.with_name(f"{log.stem}-{mode}-{seed}{log.suffix or '.jsonl'}") if log else None
    return run_storm(replace(base, seed=seed, mode=mode, incident_log=path))


def main() -> int:
    args = _parse()
    sweep = args.seeds is not None
    base = StormConfig(
        requests=args.requests or (SEEDS_REQUESTS if sweep else FULL_REQUESTS),
        concurrency=args.concurrency or (SEEDS_CONCURRENCY if sweep else FULL_CONCURRENCY),
        faults=_faults(args.faults),
        fault_rate=args.fault_rate,
        ledger_url=args.ledger_url,
        start_load_before_forward=args.load_before_forward,
    )
    modes: list[Mode] = ["read", "write"] if args.mode == "both" else [args.mode]
    seeds = args.seeds if sweep else [args.seed if args.seed is not None else 1]
    results: list[StormResult] = []
    failed: list[tuple[int, str]] = []
    started = time.perf_counter()
    for seed in seeds:
        for mode in modes:
            try:
                result = _storm(base, seed, mode, args.log)
            except SimulationError as error:
                if not sweep:
                    raise
                failed.append((seed, mode))
                print(f"FAIL {error}")
                continue
            results.append(result)
            if not sweep:
                print("\n".join(account(result)))
            elif not result.ok:
                failed.append((seed, mode))
                print(f"FAIL seed {seed} {mode}: {'; '.join(result.problems)}")
                order = " --load-before-forward" if args.load_before_forward else ""
                print(
                    f"  replay: python benchmarks/storm.py --seed {seed} --mode {mode} --requests {base.requests} "
                    f"--concurrency {base.concurrency} --faults {args.faults} --fault-rate {base.fault_rate}{order}"
                )
    if sweep:
        print(f"{len(seeds)} seeds x {len(modes)} modes in {time.perf_counter() - started:.1f} s: "
              f"{len(failed)} failed" + (f" ({failed})" if failed else ""))  # fmt: skip
        # Per mode, the seed where naive bookkeeping stranded the most, beside kvledger on that seed.
        worst = [max((r for r in results if r.mode == m), key=lambda r: r.naive_leaked_blocks) for m in modes]
        print(side_by_side(worst))
    else:
        print(side_by_side(results))
    out = figures(results)
    control_failed = False
    if not sweep and not args.no_control and "late_reader" in base.faults:
        control = _controls(base, modes, seeds[0])
        out.update(control)
        control_failed = (
            control["naive_corrupt_receives"] == 0
            or control["no_death_failed_storms"] > 0
            or control["no_death_corrupt_receives"] > 0
            or control["leases_off_corrupt_receives"] > 0
            or control["leases_off_premature_releases"] > 0
        )
    print(json.dumps(out))
    return 1 if failed or control_failed or any(not r.ok for r in results) else 0


def _controls(base: StormConfig, modes: list[Mode], seed: int) -> dict[str, int]:
    """Without peer_death (a dead producer fails every late read, hiding what these are about): the storms
    with every protection (the leases hold the late readers' KV), with leases off (refusal alone must keep
    every late read off reused blocks), and the negative control (every protection off: the late reads must
    be seen to land on other requests' KV)."""
    faults = base.faults - {"peer_death"}
    leased = [run_storm(replace(base, seed=seed, mode=m, faults=faults)) for m in modes]
    refusing = [run_storm(replace(base, seed=seed, mode=m, faults=faults, kv_lease_duration_s=0.0)) for m in modes]
    naive = [run_storm(replace(base, seed=seed, mode=m, faults=faults, protections=False)) for m in modes]
    return {
        "no_death_late_reads": sum(r.late_reads for r in leased),
        "no_death_lease_renewals": sum(r.lease_renewals for r in leased),
        "no_death_lease_expiries": sum(r.lease_expiries for r in leased),
        "no_death_corrupt_receives": sum(r.corrupt_receives for r in leased),
        "no_death_premature_releases": sum(r.premature_releases for r in leased),
        "no_death_failed_storms": sum(1 for r in leased if not r.ok),
        "leases_off_late_reads": sum(r.late_reads for r in refusing),
        "leases_off_late_reads_refused": sum(r.late_reads_refused for r in refusing),
        "leases_off_corrupt_receives": sum(r.corrupt_receives for r in refusing),
        "leases_off_premature_releases": sum(r.premature_releases for r in refusing),
        "naive_late_reads": sum(r.late_reads for r in naive),
        "naive_corrupt_receives": sum(r.corrupt_receives for r in naive),
        "naive_premature_releases": sum(r.premature_releases for r in naive),
    }


if __name__ == "__main__":
    raise SystemExit(main())
