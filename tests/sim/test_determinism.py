"""One seed, one run: the same seed reproduces the decisions and figures, in this process and in another."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from kvledger.connector.sim.config import StormConfig, StormResult
from kvledger.connector.sim.storm import run_storm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = StormConfig(seed=5, requests=600, concurrency=128, fault_rate=0.05)
SUBPROCESS_TIMEOUT_S = 120

VOLATILE = ("wall_seconds", "incident_log", "hook_us_max")
"""Real time and paths differ between runs; everything else must not."""


def _figures(result: StormResult) -> dict[str, object]:
    out = dataclasses.asdict(result)
    for name in VOLATILE:
        out.pop(name)
    return out


def test_same_seed_same_run_in_process() -> None:
    for mode in ("read", "write"):
        config = dataclasses.replace(CONFIG, mode=mode)
        first, second = run_storm(config), run_storm(config)
        assert first.ok and second.ok, (first.problems, second.problems)
        a, b = _figures(first), _figures(second)
        assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        other = run_storm(dataclasses.replace(config, seed=config.seed + 1))
        assert other.fingerprint != first.fingerprint


def test_same_seed_same_run_in_another_process_with_other_hash_seeds() -> None:
    script = (
        "import dataclasses, json, sys\n"
        "from kvledger.connector.sim.config import StormConfig\n"
        "from kvledger.connector.sim.storm import run_storm\n"
        "r = run_storm(StormConfig(seed=5, requests=600, concurrency=128, fault_rate=0.05, mode='write'))\n"
        "out = dataclasses.asdict(r); out.pop('wall_seconds'); out.pop('incident_log'); out.pop('hook_us_max')\n"
        "print(json.dumps(out, sort_keys=True))\n"
    )
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=SUBPROCESS_TIMEOUT_S, check=True,
        )  # fmt: skip
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    a, b = outputs
    assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    here = json.loads(json.dumps(_figures(run_storm(dataclasses.replace(CONFIG, mode="write"))), sort_keys=True))
    assert here == a, {k: (here[k], a[k]) for k in a if here[k] != a[k]}
