"""`--quick`: every benchmark's smoke size, seconds long, that CI runs (tests/test_benchmarks_quick.py).

A quick run measures nothing worth quoting; it proves the script still runs end to end and still prints
every field its FIELDS names. The flag is also put in the environment (QUICK_ENV), so that a benchmark's
child processes take the same small sizes.
"""

from __future__ import annotations

import argparse
import os

QUICK_ENV = "KVLEDGER_BENCH_QUICK"


def quick() -> bool:
    """Whether this process runs at the smoke size (its own --quick, or its parent's)."""
    return os.environ.get(QUICK_ENV, "") not in ("", "0")


def parse_args(parser: argparse.ArgumentParser, **small: object) -> argparse.Namespace:
    """`parser`'s arguments plus `--quick`, which sets every argument named in `small` to its value there."""
    sizes = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in small.items())
    parser.add_argument("--quick", action="store_true", help=f"a smoke run of seconds, for CI ({sizes})")
    args = parser.parse_args()
    if args.quick or quick():
        args.quick = True
        os.environ[QUICK_ENV] = "1"
        for name, value in small.items():
            setattr(args, name, value)
    return args
