"""Service start over a SQL store with partition workers: `kvledger serve --db sqlite:///... --partitions all
--workers N` for each N of `--workers` (default 1,2), against the one-process service, over one SQLite store.

The store (`--events`, default 1M, `kvledger.ledger.synth` traffic written with raw sqlite3 rows as
benchmarks/ready.py writes it) is made once. Each start is a `kvledger serve` process timed from its start
until /fleet/status says every partition is folded through the store's last cursor (`start_s_workers_N`),
and the CPU seconds the service and its workers had spent by then (`cpu_s_workers_N`, from /proc: on a
machine whose cores other work shares, the wall time stretches and the CPU seconds do not), and those of
its busiest worker (`cpu_s_busiest_worker_N`: with a core each, the start takes about that long). Each N runs
under a service name of its own, so it folds the store from zero; then the last N starts again and
restores its partitions' snapshots (`restore_s`, `restore_cpu_s`: nothing folded again). The baseline in
the same run: the one-process service (`serve` without --partitions; the store holds no snapshot of its
own), timed until /healthz answers (its start folds the store): `start_s_one_process`, `cpu_s_one_process`.
`same_findings`: every start's /audit at one `now` (every finding) equals the one-process service's. `load_1m` is the
machine's load average as the run ends. Ends with one JSON line.
Usage: python benchmarks/sql_workers.py [--events 1000000] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from itertools import islice
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

from benchmarks.quick import parse_args
from benchmarks.ready import append_raw
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.synth import SynthConfig, generate

FIELDS: tuple[str, ...] = (
    "events",
    "workers",
    "start_s_workers",
    "cpu_s_workers",
    "cpu_s_busiest_worker",
    "restore_s",
    "restore_cpu_s",
    "start_s_one_process",
    "cpu_s_one_process",
    "same_findings",
    "load_1m",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""

POLL_S = 0.05
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cpu_s(pids: list[int]) -> float:
    """utime + stime of `pids` (each read from /proc; a process gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS_PER_S


def _get(base: str, path: str) -> Any:
    with urllib.request.urlopen(f"{base}{path}", timeout=600) as response:
        return json.loads(response.read())


def _start(url: str, extra: list[str], ready: Any) -> tuple[float, float, float, str, subprocess.Popen[bytes]]:
    """A `kvledger serve` process over `url`: (seconds until `ready(base)` returns its workers' pids, the CPU
    seconds of the service and its workers then, those of the busiest worker, its base URL, the process)."""
    port = free_loopback_ports(1)[0]
    base = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", "serve", "--db", url, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "KVLEDGER_PAGE_LIMIT_MAX": "10000000"},
    )  # fmt: skip
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"kvledger serve {' '.join(extra)} exited with {process.returncode}")
        try:
            pids = ready(base)
        except OSError:  # not up yet, or refused (an HTTPError is an OSError)
            pids = None
        if pids is not None:
            break
        time.sleep(POLL_S)
    took = time.perf_counter() - began
    cpu = _cpu_s([process.pid, *pids])
    return took, cpu, max((_cpu_s([pid]) for pid in pids), default=0.0), base, process


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    args = parse_args(parser, events=3_000, workers="2")
    counts = [int(n) for n in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-sql-workers-") as folder:
        path = Path(folder) / "ledger.db"
        url = f"sqlite:///{path}"
        store = open_store(url, create=True)
        store.close()
        synth = generate(SynthConfig(transfers=args.events, concurrency=64, fault_rate=0.01), seed=11)
        append_raw(path, list(islice(synth, args.events)))
        store = open_store(url)
        ((last_cursor, last),) = store.tail(store.count() - 1, 1)  # raw rows: cursors 1 to the count
        last_ts = max(e.ts for e in store.read(ts_from=last.ts - 60.0))
        store.close()
        now = last_ts + 1.0

        def caught_up(base: str) -> list[int] | None:
            status = _get(base, "/fleet/status")
            if all(p["upto"] >= last_cursor for p in status["folded"].values()):
                return [w["pid"] for w in status["workers"]]
            return None

        def answered(base: str) -> list[int] | None:
            _get(base, "/healthz")
            return []

        audits: list[Any] = []
        start_s: dict[str, float] = {}
        cpu_s: dict[str, float] = {}
        busiest: dict[str, float] = {}
        for n in counts:
            extra = ["--partitions", "all", "--workers", str(n), "--service", f"w{n}"]
            took, cpu, worker_cpu, base, process = _start(url, extra, caught_up)
            start_s[str(n)], cpu_s[str(n)], busiest[str(n)] = round(took, 2), round(cpu, 2), round(worker_cpu, 2)
            audits.append(_get(base, f"/audit?now={now!r}&limit=10000000")["findings"])
            _stop(process)
        took, cpu, _, base, process = _start(url, extra, caught_up)
        status = _get(base, "/fleet/status")
        assert all(p["restored"] == p["applied"] for p in status["folded"].values()), "a partition folded again"
        restore_s, restore_cpu_s = round(took, 2), round(cpu, 2)
        audits.append(_get(base, f"/audit?now={now!r}&limit=10000000")["findings"])
        _stop(process)
        one_took, one_cpu, _, base, process = _start(url, [], answered)
        one = _get(base, f"/audit?now={now!r}&limit=10000000")["findings"]
        _stop(process)
    print(
        json.dumps(
            {
                "events": args.events,
                "workers": counts,
                "start_s_workers": start_s,
                "cpu_s_workers": cpu_s,
                "cpu_s_busiest_worker": busiest,
                "restore_s": restore_s,
                "restore_cpu_s": restore_cpu_s,
                "start_s_one_process": round(one_took, 2),
                "cpu_s_one_process": round(one_cpu, 2),
                "same_findings": all(a == one for a in audits),
                "load_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
