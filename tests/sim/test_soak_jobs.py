"""A soak's merged log through the real `kvledger replay` and `audit` with `--jobs 1` and `--jobs 3`: the
printed output is the same, byte for byte (every fault kind, restarts, reused ids, many compactions)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from kvledger.connector.sim.soak_config import SoakConfig
from kvledger.connector.sim.storm import run_soak

CONFIG = SoakConfig(seed=20261201, sim_hours=1.5, restart_gap_min_s=600.0, restart_gap_max_s=1200.0)


def _run(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args, "--fail-on", "never"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_a_soaks_log_prints_the_same_with_one_job_and_three(tmp_path: Path) -> None:
    log = tmp_path / "soak.jsonl"
    result = run_soak(dataclasses.replace(CONFIG, mode="read", incident_log=log))
    assert result.problems == []
    for command in (["replay"], ["replay", "--json"], ["audit", "--json"]):
        one = _run(*command, str(log), "--jobs", "1")
        three = _run(*command, str(log), "--jobs", "3")
        assert three == one, command
    document = json.loads(_run("replay", str(log), "--json", "--jobs", "3"))
    assert document["events"] > 16_384 and document["decisions"]  # more than one compaction pass
    assert document["summary"]["compaction"]["tombstones"] > 0
    assert document["summary"]["findings_by_code"]  # the faults left evidence to merge
