"""The compiled scheduler hooks and the interpreted ones are the same hooks (connector/compiled.py): the
simulator's storms (both modes, faults injected) reach the same decisions, figures and log fingerprint on
either build; the environment variable and a stale build load the sources.

Where nothing is compiled there is one build only, and these are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvledger.connector.scheduler
from kvledger.connector.compiled import HOOK_MODULES, compiled
from kvledger.connector.sim.config import StormConfig
from kvledger.connector.sim.storm import run_storm
from kvledger.ledger.compiled import INTERPRETED_ENV
from tests.ledger.test_both_builds import checkout_copy
from tests.sim.test_determinism import VOLATILE

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [StormConfig(seed=11, requests=400, concurrency=96, fault_rate=0.08, mode=mode) for mode in ("read", "write")]
SUBPROCESS_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not compiled(), reason="the hooks run interpreted here (nothing compiled, or KVLEDGER_INTERPRETED): one build only"
)

_STORMS = (
    "import json; from kvledger.connector.compiled import compiled; "
    "from tests.connector.test_both_builds import CONFIGS, storm_figures; "
    "print(json.dumps({'compiled': compiled(), 'storms': [storm_figures(c) for c in CONFIGS]}, sort_keys=True))"
)


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != INTERPRETED_ENV} | extra


def storm_figures(config: StormConfig) -> dict[str, object]:
    """A storm's figures, less what real time and paths change (tests/sim/test_determinism.py's VOLATILE)."""
    result = run_storm(config)
    assert result.ok, result.problems
    figures = dataclasses.asdict(result)
    for name in VOLATILE:
        figures.pop(name)
    return figures


def test_both_builds_run_the_same_storms() -> None:
    here = json.loads(json.dumps([storm_figures(config) for config in CONFIGS], sort_keys=True))
    done = subprocess.run(
        [sys.executable, "-c", _STORMS], cwd=ROOT, env=_env(**{INTERPRETED_ENV: "1", "PYTHONPATH": str(ROOT)}),
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=True,
    )  # fmt: skip
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["compiled"] is False, "the subprocess ran the sources"
    for mine, theirs in zip(here, answer["storms"], strict=True):
        assert mine["fingerprint"] == theirs["fingerprint"]
        assert mine == theirs, {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}


def test_the_environment_variable_runs_every_hook_module_from_its_source() -> None:
    probe = "import json, importlib; from kvledger.connector.compiled import HOOK_MODULES as M, compiled; "
    probe += "print(json.dumps([compiled(), [importlib.import_module(m).__file__ for m in M]]))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=_env(**{INTERPRETED_ENV: "1", "PYTHONPATH": str(ROOT)}),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    is_compiled, files = json.loads(done.stdout)
    assert is_compiled is False
    assert len(files) == len(HOOK_MODULES) and all(name.endswith(".py") for name in files), files
    assert kvledger.connector.scheduler.__file__ is not None and not kvledger.connector.scheduler.__file__.endswith(
        ".py"
    )


def test_a_hook_source_edited_after_the_build_runs_them_all_interpreted_with_a_warning(tmp_path: Path) -> None:
    """A stale compiled module never shadows an edit: the hook modules load from their sources, all of them,
    and a warning says so; the fold, built apart, still loads compiled."""
    checkout_copy(tmp_path, "ledger", "connector")
    later = time.time() + 60
    os.utime(tmp_path / "kvledger" / "connector" / "params.py", (later, later))
    probe = "from kvledger.connector import params, scheduler; from kvledger.connector.compiled import compiled; "
    probe += "from kvledger.ledger import fold; print(scheduler.__file__, params.__file__, compiled(), fold.__file__)"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", probe], cwd=tmp_path, env=_env(PYTHONPATH=str(tmp_path)),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    scheduler_file, params_file, is_compiled, fold_file = done.stdout.split()
    assert scheduler_file == str(tmp_path / "kvledger" / "connector" / "scheduler.py")
    assert params_file == str(tmp_path / "kvledger" / "connector" / "params.py")
    assert is_compiled == "False"
    assert not fold_file.endswith(".py"), fold_file
    assert "params.py in" in done.stderr and "changed after its modules were compiled" in done.stderr
