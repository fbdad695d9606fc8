"""The compiled fold and the interpreted one are the same fold (issue 19, item 1): on the same generated
histories (tests/ledger/both_builds.py: unkind histories in the property tests' shapes and synthetic
traffic with faults, folded whole, replayed with compaction past the tombstone bound, and run as a
forgetting ledger through a snapshot) they take the same decisions and report the same findings.

Where nothing is compiled (no C compiler at install) there is one build only, and these are skipped;
the rest of tests/ledger runs on whichever build loads (`KVLEDGER_INTERPRETED=1` picks the sources).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvledger.ledger.fold
from kvledger.ledger.compiled import INTERPRETED_ENV, compiled
from tests.ledger.both_builds import digests

ROOT = Path(__file__).resolve().parent.parent.parent
SEEDS = range(0, 120)
CHUNKS = [SEEDS[i : i + 30] for i in range(0, len(SEEDS), 30)]
"""Four tests of 30 seeds rather than one of 120: pytest-xdist spreads them over its workers."""


def checkout_copy(destination: Path, *folders: str) -> None:
    """Copies of the top-level `folders` where `import kvledger.<folder>` finds them first (`destination` first on
    sys.path): under kvledger/, beside its `__init__.py`, as the checkout's kvledger/ shows them."""
    package = destination / "kvledger"
    package.mkdir(exist_ok=True)
    shutil.copy2(ROOT / "kvledger" / "__init__.py", package / "__init__.py")
    for folder in folders:
        shutil.copytree(ROOT / folder, package / folder, ignore=shutil.ignore_patterns("__pycache__"))


pytestmark = pytest.mark.skipif(
    not compiled(), reason="the fold runs interpreted here (nothing compiled, or KVLEDGER_INTERPRETED): one build only"
)


def _interpreted(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, INTERPRETED_ENV: "1", "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)


@pytest.mark.parametrize("seeds", CHUNKS, ids=[f"seeds{c[0]}-{c[-1]}" for c in CHUNKS])
def test_both_builds_decide_and_find_the_same_on_generated_histories(seeds: range) -> None:
    here = digests(seeds)
    answer = json.loads(_interpreted(["-m", "tests.ledger.both_builds", str(seeds[0]), str(len(seeds))]).stdout)
    assert answer["compiled"] is False, "the subprocess ran the sources"
    differing = [seed for seed, a, b in zip(seeds, here, answer["digests"], strict=True) if a != b]
    assert differing == [], f"the builds part on seeds {differing} (python -m tests.ledger.both_builds SEED 1 --full)"


def test_the_environment_variable_runs_every_fold_module_from_its_source() -> None:
    probe = "import json, importlib; from kvledger.ledger.compiled import FOLD_MODULES as M, compiled; "
    probe += "print(json.dumps([compiled(), [importlib.import_module(m).__file__ for m in M]]))"
    is_compiled, files = json.loads(_interpreted(["-c", probe]).stdout)
    assert is_compiled is False
    assert all(name.endswith(".py") for name in files), files
    assert kvledger.ledger.fold.__file__ is not None and not kvledger.ledger.fold.__file__.endswith(".py"), (
        "this process: compiled"
    )


def test_a_source_edited_after_the_build_runs_interpreted_with_a_warning(tmp_path: Path) -> None:
    """A stale compiled module never shadows an edit: the sources load instead (all of them: the compiled
    modules are bound to each other's types), and a warning says so."""
    checkout_copy(tmp_path, "ledger")
    later = time.time() + 60
    os.utime(tmp_path / "kvledger" / "ledger" / "fold.py", (later, later))
    probe = "from kvledger.ledger import fold, side; print(fold.__file__); print(side.__file__)"
    env = {k: v for k, v in os.environ.items() if k != INTERPRETED_ENV} | {"PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    fold_file, side_file = done.stdout.split()
    assert fold_file == str(tmp_path / "kvledger" / "ledger" / "fold.py")
    assert side_file == str(tmp_path / "kvledger" / "ledger" / "side.py")
    assert "fold.py in" in done.stderr and "changed after the fold was compiled" in done.stderr


def test_an_event_class_edited_after_the_build_runs_the_fold_interpreted(tmp_path: Path) -> None:
    """The compiled fold reads events by their layout when it was built: an edit of events.py since
    (a field renamed, added) must not have it read the wrong field."""
    checkout_copy(tmp_path, "ledger")
    later = time.time() + 60
    os.utime(tmp_path / "kvledger" / "ledger" / "events.py", (later, later))
    probe = "from kvledger.ledger import compiled, fold; print(compiled.compiled())"
    env = {k: v for k, v in os.environ.items() if k != INTERPRETED_ENV} | {"PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["False"]
    assert "events.py in" in done.stderr


def test_a_build_that_compiled_only_some_modules_runs_them_all_interpreted(tmp_path: Path) -> None:
    """The compiled modules are bound to each other's types: with one missing, all run from source."""
    checkout_copy(tmp_path, "ledger")
    for built in (tmp_path / "kvledger" / "ledger").glob("upkeep.*.so"):
        built.unlink()
    probe = "from kvledger.ledger import compiled, fold; print(compiled.compiled(), fold.__file__)"
    env = {k: v for k, v in os.environ.items() if k != INTERPRETED_ENV} | {"PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["False", str(tmp_path / "kvledger" / "ledger" / "fold.py")]
    assert "upkeep.py in" in done.stderr
