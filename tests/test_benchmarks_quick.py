"""Benchmarks that cannot rot: every script in benchmarks/ runs at its `--quick` size and ends with the JSON line
its FIELDS names. A script is any benchmarks/*.py with a `__main__` block (helpers such as quick.py have none),
found here by listing the folder: a benchmark added tomorrow is run without this file changing."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
QUICK_TIMEOUT_S = 600


def _is_script(path: Path) -> bool:
    return path.name != "__init__.py" and 'if __name__ == "__main__":' in path.read_text()


SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if _is_script(path))


def declared_fields(path: Path) -> tuple[str, ...]:
    """The module constant FIELDS, read from the source (importing a benchmark may start work)."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "FIELDS" and node.value is not None:  # type: ignore[union-attr]
            fields = ast.literal_eval(node.value)  # type: ignore[union-attr]
            assert isinstance(fields, tuple) and fields, f"{path.name}: FIELDS must be a non-empty tuple"
            assert all(isinstance(f, str) for f in fields), f"{path.name}: FIELDS must hold strings"
            return fields
    raise AssertionError(f"{path.name}: no module constant `FIELDS: tuple[str, ...]` naming its JSON line's fields")


def test_the_benchmarks_are_found() -> None:
    names = {path.stem for path in SCRIPTS}
    assert {"fold", "store", "mutation", "fleet"} <= names, names
    assert "quick" not in names and "__init__" not in names


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[path.stem for path in SCRIPTS])
def test_quick_run_prints_every_field(script: Path) -> None:
    fields = declared_fields(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, str(script), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{script.name} --quick failed ({done.returncode}):\n{done.stderr[-3000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{script.name} --quick printed nothing"
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError as error:
        raise AssertionError(f"{script.name}: its last line is not JSON ({error}): {lines[-1][:300]}") from None
    assert isinstance(figures, dict), lines[-1][:300]
    missing = [field for field in fields if field not in figures]
    assert not missing, f"{script.name}: FIELDS names {missing}, absent from its JSON line {sorted(figures)}"
