"""Mutation testing of the fold, the audit and the partition merge: how many small wrong versions of the fold
(`ledger/fold.py`, `side.py`, `indexes.py`, `upkeep.py`), `ledger/audit.py`, `ledger/partition.py`, the
partition merge `ledger/partitioned.py` with its block ownership `ledger/ownership.py`, and `ledger/merge.py`
(a flipped comparison, a dropped guard, a constant off by one, a string changed) the ledger tests catch. Prints
the figures and every survivor, then one JSON line.

Run:
    python benchmarks/mutation.py                # every 4th mutant of those files (deterministic), 2 workers
    python benchmarks/mutation.py --quick        # every 4th of the partition functions' mutants (CI's smoke run)
    python benchmarks/mutation.py --offset 1     # another quarter (--offset 0 to 3 cover them all)
    python benchmarks/mutation.py --every 1      # all of them (about 2,800: hours on 2 cores)
    python benchmarks/mutation.py --jobs 8 --keep /tmp/mutation   # keep the work folder (`mutmut show NAME` there)
    python benchmarks/mutation.py --resume /tmp/mutation          # the tests again over a kept folder's survivors

Needs mutmut 3 (`pip install "mutmut==3.8.1"`; it is installed with pip when missing). mutmut rather
than cosmic-ray: it forks one worker per mutant from a process that has imported pytest and the tests,
switches mutants by trampoline (no file rewrite per mutant) and runs only the tests that reach the
mutated function, stopping at the first failure; cosmic-ray starts a fresh interpreter and the whole
test command per mutant, several times slower here.

What runs: a scratch copy of `ledger/`, `tests/ledger/` and the helpers of `tests/fuzz/` (the fast tests that
kill fold and audit mutants: rules, properties against the reference oracle, compaction, boundaries), so the
working tree is never touched. Hypothesis runs without shrinking there (the `mutation` profile in
tests/ledger/conftest.py): a property that fails kills the mutant at its first failing example.

`--resume DIR` takes a folder an earlier `--keep DIR` run left, copies the code and the tests in again
and runs only the sample's mutants without a verdict of caught: survivors, those not run when that run
was stopped, and those of every function whose code changed since (mutmut keeps a hash of each function
and forgets the verdicts of a changed one). A caught mutant of unchanged code keeps its verdict, which
holds while tests are only added or strengthened (a test deleted or weakened since: run afresh). It
refuses a folder made for other files or tests.

The sample: mutants sorted by file, function and mutmut's number, then every `--every`-th (the 1st,
the k+1-th, ...): every function keeps its share, and the same source gives the same sample. A
mutant that hangs past its time limit (4 x (its tests' time + 5 s) of CPU, mutmut's limit with
`timeout_multiplier` 2: a hanging mutant costs minutes at 10) counts as killed (the tests noticed); one
reached by no test counts as survived.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

from benchmarks.quick import parse_args

ROOT = Path(__file__).resolve().parent.parent
MUTMUT_VERSION = "3.8.1"
MUTATED = (
    "ledger/fold.py",
    "ledger/side.py",
    "ledger/indexes.py",
    "ledger/upkeep.py",
    "ledger/audit.py",
    "ledger/partition.py",
    "ledger/partitioned.py",
    "ledger/ownership.py",
    "ledger/merge.py",
)
TESTS = "tests/ledger"
SUPPORT = ("tests/fuzz", "tests/data")
"""What the ledger tests read beside their own folder (tests/ledger/test_valid.py uses tests.fuzz's strategies,
test_exact_memory.py a case's settings in tests/data): copied too."""
DEFAULT_EVERY = 4
FIRST_BATCH = "kvledger.ledger.audit.x_counts_by_code__mutmut_*"
"""A few quick mutants run first: mutmut generates every mutant and measures the tests on its way to them."""

QUICK_MUTATED = ("ledger/partition.py",)
QUICK_TESTS = "tests/ledger/test_partition.py"
QUICK_FIRST_BATCH = "kvledger.ledger.partition.x_partition_of__mutmut_1"
QUICK_EVERY = 4
"""--quick: every 4th mutant of the partition functions against their own tests (seconds): the pipeline, not a
score."""

FIELDS: tuple[str, ...] = (
    "mutants", "mutants_generated", "killed", "timeouts", "survived", "score", "sampled", "files", "tests", "mutmut",
)  # fmt: skip

KILLED = {1, 3}
TIMEOUT = {24, -24, 36, 152, 255}
CRASHED = {-11, -9}
"""mutmut's exit codes (mutmut/stats.py); 0 is survived, 33 and 5 no tests, None not run."""


def setup_cfg(mutated: tuple[str, ...], tests: str) -> str:
    """mutmut's configuration: which files it mutates, which tests it runs."""
    files = "\n    ".join(f"kvledger/{path}" for path in mutated)
    return f"""[mutmut]
source_paths = kvledger/ledger/
also_copy = kvledger/__init__.py
only_mutate = {files}
pytest_add_cli_args_test_selection = {tests}
pytest_add_cli_args = -p
    no:cacheprovider
    -W
    ignore
timeout_multiplier = 2.0
timeout_constant = 5.0
use_git_change_detection = false
"""


def _ensure_mutmut() -> str:
    """mutmut's command, installed with pip when missing or not version 3."""
    found = shutil.which("mutmut")
    version = ""
    if found:
        probe = subprocess.run([sys.executable, "-m", "pip", "show", "mutmut"], capture_output=True, text=True)
        version = next((line.split()[-1] for line in probe.stdout.splitlines() if line.startswith("Version:")), "")
    if not found or not version.startswith("3."):
        print(f"installing mutmut=={MUTMUT_VERSION} ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"mutmut=={MUTMUT_VERSION}"], check=True)
        found = shutil.which("mutmut") or str(Path(sys.executable).with_name("mutmut"))
    return found


IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "*.so")


def _scratch(work: Path, mutated: tuple[str, ...], tests: str) -> None:
    """The code and the tests, copied: mutmut writes its `mutants/` folder next to them."""
    package = work / "kvledger"  # as the checkout lays it out: mutmut names mutants by their module's path
    package.mkdir()
    shutil.copy2(ROOT / "kvledger" / "__init__.py", package / "__init__.py")
    shutil.copytree(ROOT / "ledger", package / "ledger", ignore=IGNORED)
    _copy_tests(work, tests)
    (work / "setup.cfg").write_text(setup_cfg(mutated, tests))


def _copy_tests(work: Path, tests: str) -> None:
    """The tests and their helpers, copied over whatever an earlier run left (mutmut copies them on into
    `mutants/` at every run)."""
    (work / "tests").mkdir(exist_ok=True)
    shutil.copy2(ROOT / "tests" / "__init__.py", work / "tests" / "__init__.py")
    folder = tests if (ROOT / tests).is_dir() else str(Path(tests).parent)
    shutil.copytree(ROOT / folder, work / folder, ignore=IGNORED, dirs_exist_ok=True)
    for support in SUPPORT:  # helpers only: their own test files import the service's fixtures
        helpers = shutil.ignore_patterns("test_*.py", "__pycache__")
        shutil.copytree(ROOT / support, work / support, ignore=helpers, dirs_exist_ok=True)


def _resumable(work: Path, mutated: tuple[str, ...], tests: str) -> str | None:
    """Why a kept folder cannot be resumed (not made by this script, or for other files or tests), or None."""
    cfg = work / "setup.cfg"
    if not cfg.is_file() or cfg.read_text() != setup_cfg(mutated, tests) or not (work / "mutants").is_dir():
        return f"{work} is not a folder this script kept for {', '.join(mutated)} against {tests}"
    return None


def _mutmut(command: str, work: Path, args: list[str], log: Path) -> None:
    env = dict(os.environ, KVLEDGER_HYPOTHESIS_PROFILE="mutation")
    with log.open("ab") as out:
        done = subprocess.run([command, *args], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"mutmut {' '.join(args[:3])} ... failed ({done.returncode}); its log ends:\n{tail}")


def _results(work: Path, mutated: tuple[str, ...]) -> dict[str, int | None]:
    """Every mutant's name and exit code, from mutmut's per-file records."""
    out: dict[str, int | None] = {}
    for path in mutated:
        meta = json.loads((work / "mutants" / "kvledger" / f"{path}.meta").read_text())
        out.update(meta["exit_code_by_key"])
    return out


def _order(name: str) -> tuple[str, int]:
    function, _, number = name.rpartition("__mutmut_")
    return function, int(number)


def _location(work: Path, name: str) -> str:
    """The mutated line: `file:line: original -> mutant`, from the diff mutmut shows."""
    done = subprocess.run(
        [shutil.which("mutmut") or "mutmut", "show", name], cwd=work, capture_output=True, text=True
    )  # fmt: skip
    minus = [
        line[1:].strip() for line in done.stdout.splitlines() if line.startswith("-") and not line.startswith("---")
    ]
    plus = [
        line[1:].strip() for line in done.stdout.splitlines() if line.startswith("+") and not line.startswith("+++")
    ]
    return f"{' | '.join(minus)} -> {' | '.join(plus)}" if minus or plus else done.stdout.strip()[:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY, help="test every k-th mutant (1: all)")
    parser.add_argument("--offset", type=int, default=0, help="start the sample at this mutant (0 to k-1)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--keep", type=Path, default=None, help="work in (and keep) this folder")
    parser.add_argument(
        "--resume", type=Path, default=None, help="rerun the uncaught mutants of a folder kept by --keep"
    )  # fmt: skip
    args = parse_args(parser, every=QUICK_EVERY, offset=0)
    quick = (QUICK_MUTATED, QUICK_TESTS, QUICK_FIRST_BATCH)
    mutated, tests, first = quick if args.quick else (MUTATED, TESTS, FIRST_BATCH)
    if args.every < 1 or args.jobs < 1 or not 0 <= args.offset < args.every:
        parser.error("--every and --jobs must be >= 1, --offset in [0, --every)")
    if args.resume is not None and args.keep is not None:
        parser.error("--resume keeps its folder; give it alone")
    command = _ensure_mutmut()
    work = args.resume or args.keep or Path(tempfile.mkdtemp(prefix="kvledger-mutation-"))
    if args.resume is not None:
        refused = _resumable(work, mutated, tests)
        if refused:
            parser.error(refused)
        shutil.copytree(ROOT / "ledger", work / "kvledger" / "ledger", ignore=IGNORED, dirs_exist_ok=True)
        _copy_tests(work, tests)
    else:
        if work.exists() and any(work.iterdir()):
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        _scratch(work, mutated, tests)
    log = work / "mutmut.log"
    started = time.perf_counter()
    jobs = ["--max-children", str(args.jobs)]
    print(f"mutmut {MUTMUT_VERSION} over {', '.join(mutated)} against {tests} in {work} ...", flush=True)
    _mutmut(command, work, ["run", *jobs, first], log)  # on --resume: the mutants of the code as it is now
    every = sorted(_results(work, mutated), key=_order)
    sample = every[args.offset :: args.every]
    if args.resume is not None:
        before = _results(work, mutated)
        rerun = [name for name in sample if before[name] not in KILLED | TIMEOUT | CRASHED]
        print(f"{len(every)} mutants; every {args.every}: {len(sample)}; rerunning {len(rerun)} uncaught", flush=True)
    else:
        rerun = sample
        print(f"{len(every)} mutants; testing every {args.every}: {len(sample)}", flush=True)
    if rerun:
        _mutmut(command, work, ["run", *jobs, *rerun], log)
    results = _results(work, mutated)
    codes = [results[name] for name in sample]
    killed = sum(code in KILLED for code in codes)
    timeouts = sum(code in TIMEOUT for code in codes)
    crashed = sum(code in CRASHED for code in codes)
    survivors = [name for name, code in zip(sample, codes, strict=True) if code not in KILLED | TIMEOUT | CRASHED]
    caught = killed + timeouts + crashed
    modules = {path: "kvledger." + path.removesuffix(".py").replace("/", ".") + "." for path in mutated}
    by_file = {path: sum(name.startswith(module) for name in sample) for path, module in modules.items()}
    per_file = ", ".join(f"{path}: {n}" for path, n in by_file.items())
    print(f"tested {len(sample)} ({per_file}) in {time.perf_counter() - started:.0f} s")
    print(f"killed {killed}, timed out {timeouts}, crashed {crashed}, survived {len(survivors)}")
    for name in survivors:
        status = "no tests" if results[name] in (5, 33) else "survived"
        short = name.removeprefix("kvledger.ledger.")
        print(f"  {status}: {short}: {_location(work, name)}")
    if args.keep is None and args.resume is None:
        shutil.rmtree(work, ignore_errors=True)
    figures = {
        "mutants": len(sample),
        "mutants_generated": len(every),
        "killed": caught,
        "timeouts": timeouts,
        "survived": len(survivors),
        "score": round(caught / len(sample), 4) if sample else 0.0,
        "sampled": f"every {args.every}th from {args.offset} by file, function, number" if args.every > 1 else False,
        "files": list(mutated),
        "tests": tests,
        "mutmut": MUTMUT_VERSION,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
