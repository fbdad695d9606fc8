"""`kvledger demo`: the main job on the embedded default — a seeded P/D fault storm, its audit beside
naive bookkeeping on the same seed, then the audit service over the ledger it wrote."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from kvledger.ledger.humanize import duration, utc

if TYPE_CHECKING:
    from kvledger.api.settings import Settings

DEMO_DIR_DEFAULT = Path("kvledger-demo")

Dir = Annotated[Path, typer.Option("--dir", help="Where the ledger (SQLite) and incident log go; replaced each run")]
Requests = Annotated[int, typer.Option(help="Requests in the storm")]
Concurrency = Annotated[int, typer.Option(help="Requests in flight at once")]
Seed = Annotated[int, typer.Option(help="The seed: the same seed replays the same storm")]
Mode = Annotated[str, typer.Option(help="read (the consumer pulls) or write (the producer pushes)")]
Port = Annotated[int, typer.Option(help="Port of the audit service on 127.0.0.1")]
Serve = Annotated[bool, typer.Option("--serve/--no-serve", help="Start the audit service afterwards")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the figures as one JSON object")]


def _table(result: Any) -> Table:
    table = Table(title=f"seed {result.seed}: {result.requests} requests, concurrency {result.concurrency}, "
                  f"{result.mode.upper()} mode, faults injected {sum(result.faults_injected.values())}",
                  title_justify="left", box=box.SIMPLE_HEAD)  # fmt: skip
    table.add_column("after every deadline passed")
    table.add_column("kvledger (the fold decides)", justify="right")
    table.add_column("naive bookkeeping, same seed", justify="right")
    table.add_row("blocks still held", str(result.leaked_blocks), str(result.naive_leaked_blocks))
    table.add_row("requests never finished (hung)", str(result.hung_requests), str(result.naive_hung_requests))
    table.add_row("acks dropped as unmapped", "0", str(result.naive_dropped_acks))
    table.add_row("double releases", str(result.double_releases), "-")
    table.add_row("premature releases", str(result.premature_releases), "-")
    table.add_row("corrupt receives (checksums)", str(result.integrity_failures), "-")
    return table


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(counts.items()) if n) or "none"


def demo_command(
    directory: Dir = DEMO_DIR_DEFAULT,
    requests: Requests = 2000,
    concurrency: Concurrency = 512,
    seed: Seed = 1,
    mode: Mode = "read",
    port: Port = 8000,
    serve: Serve = True,
    as_json: AsJson = False,
) -> None:
    """Run a seeded P/D fault storm on a SQLite ledger, audit it beside naive bookkeeping, then serve it."""
    if mode not in ("read", "write"):
        raise typer.BadParameter(f"{mode!r} is not read or write", param_hint="--mode")
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    if not as_json:
        out.print(f"storm: {requests} requests at concurrency {concurrency}, every fault kind on, seed {seed} ...")
    result, config = run_demo_storm(directory, requests=requests, concurrency=concurrency, seed=seed, mode=mode)
    db, log = config.ledger_url.removeprefix("sqlite:///"), config.incident_log
    if as_json:
        figures = {k: v for k, v in vars(result).items() if isinstance(v, (int, float, str, bool, dict, list))}
        sys.stdout.write(json.dumps(figures) + "\n")
    else:
        out.print(f"simulated clock: {utc(config.start_ts)} to {utc(config.start_ts + result.sim_seconds)} "
                  f"({duration(result.sim_seconds)} simulated in {duration(result.wall_seconds)})")  # fmt: skip
        out.print(_table(result))
        out.print(f"forged releases: {result.forged_sent} sent, {result.forged_messages_accepted} accepted "
                  "(refusals go to the ledger as drop events, not to the log)")  # fmt: skip
        dead = dict(result.findings_on_dead_engine)
        alive = {k: v - dead.get(k, 0) for k, v in result.findings.items()}
        out.print(f"audit findings on the live engines (both sides' merged logs): {_counts(alive)}")
        if result.dead_engine is not None:
            # The audit's code for a side held past its deadline is `leak` wherever it is; on a lost engine
            # those sides died with it, so they are named for what they are, not listed as leaks.
            held = dead.pop("leak", 0)
            out.print(f"the storm killed {result.dead_engine}: the {held} transfer sides it held died with it "
                      "(lost, not leaked: no live engine holds them)")  # fmt: skip
            out.print(f"  other findings in its log before it died: {_counts(dead)}")
        out.print(f"offline replay reproduces the live decisions: {'yes' if result.replay_matches else 'NO'}")
        out.print(f"ledger: {db}   incident log: {log}")
        out.print(f"try: kvledger replay {log}")
        for problem in result.problems:
            out.print(f"[bold red]problem:[/] {problem}")
    if result.problems:
        raise typer.Exit(1)
    if serve:
        from kvledger.cli.serve import run_service

        wait_for_storm_end(result, config)
        out.print(f"audit service: http://127.0.0.1:{port}/  (Ctrl-C to stop)")
        run_service(demo_settings(result, config), host="127.0.0.1", port=port)


def run_demo_storm(directory: Path, *, requests: int, concurrency: int, seed: int, mode: str) -> tuple[Any, Any]:
    """The demo's storm on a fresh SQLite ledger and incident log in `directory`: (StormResult, StormConfig)."""
    # The CLI is the one place that composes the packages: the simulator lives with the connector.
    from kvledger.connector.channel import REFUSED_LOGGER
    from kvledger.connector.sim import StormConfig, run_storm

    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    # The simulated clock starts at the wall clock (whole seconds, as the simulator's default does), so the
    # service's audit, which runs on the wall clock, reads real ages: the storm ended moments ago, not in 2023.
    config = StormConfig(
        seed=seed, mode=mode, requests=requests, concurrency=concurrency,
        ledger_url=f"sqlite:///{directory / 'ledger.db'}", incident_log=directory / "incident.jsonl",
        start_ts=float(int(time.time())),
    )  # fmt: skip
    # The storm forges messages on purpose; its summary counts them. A deployment keeps the channel's refusal
    # log, since there a forged message is news (connector/channel.py logs the first few from each sender).
    refused = logging.getLogger(REFUSED_LOGGER)
    level = refused.level
    refused.setLevel(logging.ERROR)
    try:
        return run_storm(config), config
    finally:
        refused.setLevel(level)


DEMO_AUDIT_ROUNDING_S = 1.0
"""The service's default audit resolution (`audit_cache_resolution_s`): its clock is rounded down by this."""


def wait_for_storm_end(result: Any, config: Any) -> None:
    """On a fast machine the simulated clock runs ahead of the wall clock; the service audits on the wall
    clock, rounded down to its audit resolution (1 s by default), so it starts once the storm's last moment
    is that far in the past: its audit then sees every deadline the storm's own audit saw pass (a lost
    producer's scheduler half holds to its lease backstop, `kv_lease_max`, which may end in the storm's
    last second)."""
    time.sleep(max(0.0, config.start_ts + result.sim_seconds + DEMO_AUDIT_ROUNDING_S - time.time()))


def demo_settings(result: Any, config: Any) -> Settings:
    """The service over the demo's ledger, with the storm's timeouts, told (as an orchestrator would tell
    it) which engine the storm killed."""
    from kvledger.cli.serve import service_settings

    dead = {result.dead_engine: "killed by the demo's storm"} if result.dead_engine is not None else {}
    return service_settings(
        config.ledger_url, defer_timeout=config.defer_timeout_s, transfer_timeout=config.transfer_timeout_s,
        dead=dead,
    )  # fmt: skip
