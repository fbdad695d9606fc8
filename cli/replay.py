"""`kvledger replay`, `audit` and `timeline`: fold incident logs offline and explain them."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvledger.ledger.advice import LatencyRecorder, timeout_advice
from kvledger.ledger.audit import SEVERITY_RANK, AuditConfig, Finding, audit
from kvledger.ledger.humanize import duration, offset, utc
from kvledger.ledger.inputs import Inputs
from kvledger.ledger.jsonl import LogFormatError
from kvledger.ledger.limits import (
    ARRIVAL_LAG_S,
    DEFAULT_CLOCK_SKEW_S,
    DEFAULT_DEFER_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
)
from kvledger.ledger.merge import OverlapError
from kvledger.ledger.replay import ReplayResult, replay_chunks
from kvledger.ledger.summary import compaction_warning, compaction_warning_of, state_counts, summarize_counts
from kvledger.ledger.timeline import build

EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
PROGRESS_MIN_BYTES = 32 << 20
"""Logs smaller than this replay in well under a second: no progress bar."""

WIDTH_WHEN_PIPED = 160
"""rich falls back to 80 columns when stdout is not a terminal: too narrow for findings."""

out = Console(highlight=False, width=None if sys.stdout.isatty() else WIDTH_WHEN_PIPED)
err = Console(stderr=True, highlight=False)

Logs = Annotated[list[Path], typer.Argument(help="JSONL incident logs or SQLite ledger files; merged by time")]
UntilSeq = Annotated[int | None, typer.Option(help="Fold only events with seq <= this (per source)")]
UntilTs = Annotated[float | None, typer.Option(help="Fold only events with ts <= this (time travel)")]
Now = Annotated[float | None, typer.Option(help="The audit clock (default: the last event's ts)")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output")]
SkipBad = Annotated[bool, typer.Option("--skip-bad-lines", help="Skip malformed lines and report them")]
FailOn = Annotated[
    str, typer.Option(help="Exit 1 when findings of this severity or worse exist: error, warning, info, never")
]
TransferTimeout = Annotated[float, typer.Option(help="Seconds without progress before stuck/orphan")]
DeferTimeout = Annotated[float, typer.Option(help="The producer's configured defer_timeout, for the advice")]
ClockSkew = Annotated[float, typer.Option(help="Allowed wall-clock skew between machines")]
Jobs = Annotated[
    int | None,
    typer.Option(
        help="Fold in this many processes, one partition of the transfers each, merged into exactly the "
        "one-process answer. Default: the cores available for logs of 64 MB or more, 1 below"
    ),
]

T = TypeVar("T")


def _bad_input(message: str) -> typer.Exit:
    sys.stderr.write(f"kvledger: error: {' '.join(message.split())}\n")  # one line, never wrapped
    return typer.Exit(EXIT_BAD_INPUT)


def guarded(fn: Callable[[], T]) -> T:
    """Run `fn`; turn bad input into one error line and exit status 2, nothing printed as success."""
    from kvledger.ledger.store.base import StoreError

    try:
        return fn()
    except (LogFormatError, OverlapError, FileNotFoundError, StoreError, ValueError) as error:
        raise _bad_input(str(error)) from None
    except IsADirectoryError as error:
        raise _bad_input(f"{error.filename}: is a directory, not a log") from None


@contextmanager
def _progress(inputs: Inputs) -> Iterator[Callable[[int], None] | None]:
    if not err.is_terminal or inputs.total_bytes < PROGRESS_MIN_BYTES:
        yield None
        return
    columns = (TextColumn("folding"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("fold", total=inputs.total_bytes)
        yield lambda _n: bar.update(task, completed=inputs.bytes_read())


def load(
    logs: list[Path], *, until_seq: int | None, until_ts: float | None, skip_bad: bool, keep_releases: bool = False
) -> tuple[ReplayResult, list[tuple[str, int, str]]]:
    def run() -> tuple[ReplayResult, list[tuple[str, int, str]]]:
        with Inputs(list(logs), skip_bad_lines=skip_bad) as inputs:
            chunks = inputs.chunks()
            with _progress(inputs) as on_progress:
                result = replay_chunks(
                    chunks, until_seq=until_seq, until_ts=until_ts, on_progress=on_progress,
                    keep_releases=keep_releases,
                )  # fmt: skip
            return result, inputs.skipped

    return guarded(run)


class Answer:
    """A folded log as the commands print it, from one process or merged from `--jobs` partitions."""

    def __init__(
        self,
        events: int,
        counts: dict[str, Any],
        latencies: LatencyRecorder,
        releases: list[Any],
        findings: list[Finding],
        clock: float,
        warning: str | None,
    ) -> None:
        self.events, self.counts, self.latencies, self.releases = events, counts, latencies, releases
        self.findings, self.clock, self.warning = findings, clock, warning


def fold(
    logs: list[Path],
    jobs: int | None,
    config: AuditConfig,
    *,
    now: float | None,
    until_seq: int | None = None,
    until_ts: float | None = None,
    skip_bad: bool,
    keep_releases: bool = False,
) -> tuple[Answer, list[tuple[str, int, str]]]:
    """Fold and audit `logs` in one process (`jobs` 1) or in `jobs` partitions, merged into the same answer
    (None: `kvledger.cli.jobs.default_jobs`)."""
    from kvledger.cli.jobs import default_jobs, fold_jobs

    n = default_jobs(logs) if jobs is None else jobs
    if n < 1:
        raise _bad_input(f"--jobs: must be at least 1, got {n}")
    if n == 1 or not all(p.is_file() for p in logs):  # a pipe is read once, by one process; a bad path fails there
        result, skipped = load(logs, until_seq=until_seq, until_ts=until_ts, skip_bad=skip_bad,
                               keep_releases=keep_releases)  # fmt: skip
        clock = now if now is not None else (result.last_ts or 0.0)
        answer = Answer(result.events, state_counts(result.state), result.latencies, result.releases,
                        audit(result.state, clock, config), clock, compaction_warning(result.state))  # fmt: skip
        return answer, skipped
    merged, skipped, clock = guarded(
        lambda: fold_jobs(
            logs,
            n,
            until_seq=until_seq,
            until_ts=until_ts,
            skip_bad=skip_bad,
            now=now,
            config=config,
            keep_releases=keep_releases,
        )
    )
    warning = compaction_warning_of(merged.counts["compaction"], ARRIVAL_LAG_S)
    answer = Answer(merged.events, merged.counts, merged.latencies, merged.releases,
                    merged.findings, clock, warning)  # fmt: skip
    return answer, skipped


def _fail_rank(fail_on: str) -> int | None:
    if fail_on == "never":
        return None
    if fail_on not in SEVERITY_RANK:
        raise _bad_input(f"--fail-on: {fail_on!r} is not one of error, warning, info, never")
    return SEVERITY_RANK[fail_on]


def _exit_for(findings: list[Finding], rank: int | None) -> None:
    if rank is not None and any(SEVERITY_RANK[f.severity] <= rank for f in findings):
        raise typer.Exit(EXIT_FINDINGS)


def _report_skipped(skipped: list[tuple[str, int, str]]) -> None:
    for name, line, why in skipped:
        sys.stderr.write(f"kvledger: skipped {name}:{line}: {why}\n")


def report_compaction(warning: str | None) -> None:
    """Never silent: when an event arrived behind the horizon of retired stamped ids, some answers are not exact."""
    if warning is not None:
        sys.stderr.write(f"kvledger: warning: {warning}\n")


def _findings_table(findings: list[Finding], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("severity", "code", "transfer", "source", "request", "blocks", "evidence seqs", "detail"):
        table.add_column(column, overflow="fold")
    for f in findings:
        evidence = ",".join(map(str, f.evidence[:8])) + ("..." if len(f.evidence) > 8 else "")
        table.add_row(
            f.severity, f.code, f.transfer_id, f.source, f.request_id or "-", str(len(f.block_ids)), evidence,
            f.detail,
        )  # fmt: skip
    return table


def _counts_table(title: str, counts: dict[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("count", justify="right")
    for key, value in counts.items():
        table.add_row(str(key), str(value))
    return table


def replay_command(
    logs: Logs,
    until_seq: UntilSeq = None,
    until_ts: UntilTs = None,
    now: Now = None,
    as_json: AsJson = False,
    skip_bad_lines: SkipBad = False,
    fail_on: FailOn = "error",
    transfer_timeout: TransferTimeout = DEFAULT_TRANSFER_TIMEOUT_S,
    defer_timeout: DeferTimeout = DEFAULT_DEFER_TIMEOUT_S,
    clock_skew: ClockSkew = DEFAULT_CLOCK_SKEW_S,
    jobs: Jobs = None,
) -> None:
    """Fold incident logs and explain them: phases, releases, held blocks, findings, timeout advice."""
    rank = _fail_rank(fail_on)
    config = guarded(lambda: AuditConfig(transfer_timeout_s=transfer_timeout, clock_skew_s=clock_skew))
    answer, skipped = fold(logs, jobs, config, now=now, until_seq=until_seq, until_ts=until_ts,
                           skip_bad=skip_bad_lines, keep_releases=as_json)  # fmt: skip
    _report_skipped(skipped)
    report_compaction(answer.warning)
    clock, findings = answer.clock, answer.findings
    summary = summarize_counts(answer.counts, findings)
    advice = timeout_advice(answer.latencies, defer_timeout_s=defer_timeout, transfer_timeout_s=transfer_timeout)
    if as_json:
        document = {
            "events": answer.events,
            "now": clock,
            "summary": summary,
            "advice": advice,
            "decisions": [msgspec.to_builtins(r) for r in answer.releases],
            "findings": [msgspec.to_builtins(f) for f in findings],
            "skipped": [{"file": n, "line": line, "error": why} for n, line, why in skipped],
        }
        sys.stdout.write(json.dumps(document) + "\n")
    else:
        _print_replay(answer.events, clock, summary, advice, findings)
    _exit_for(findings, rank)


def _print_replay(
    events: int, clock: float, summary: dict[str, Any], advice: dict[str, Any], findings: list[Finding]
) -> None:
    out.print(f"[bold]{events} events[/] folded; {summary['transfers']} transfer sides; audit clock {utc(clock)}")
    out.print(_counts_table("transfers by phase", summary["transfers_by_phase"]))
    out.print(_counts_table("transfers by mode", summary["transfers_by_mode"]))
    out.print(_counts_table("releases by cause", summary["releases_by_cause"] or {"none": 0}))
    held = summary["blocks_held"]
    style = "bold red" if held and findings and findings[0].code == "leak" else "bold"
    out.print(f"[{style}]blocks still held: {held}[/] in {summary['live_transfers']} live transfer sides")
    out.print(_counts_table("findings by code", summary["findings_by_code"] or {"none": 0}))
    if findings:
        out.print(_findings_table(findings[:10], "worst findings"))
    table = Table(title=f"timeout advice: {advice['verdict']}", title_justify="left")
    # Latencies of completed releases only (an expired side's is its timeout), as the first column says.
    for column in ("role/mode", "completed releases", "p50", "p99", "max", "timeout", "late if timeout were"):
        table.add_column(column, justify="right" if column != "role/mode" else "left")
    for kind, row in advice["by_kind"].items():
        late = ", ".join(f"{duration(float(k))}: {v}" for k, v in row["late_if_timeout_s"].items())
        table.add_row(
            kind, str(row["count"]), duration(row["p50_s"] or 0.0), duration(row["p99_s"]), duration(row["max_s"]),
            duration(row["configured_timeout_s"]), late,
        )  # fmt: skip
    out.print(table)
    out.print(
        f"expired releases: {advice['expired_releases']}, blocks pinned by them for "
        f"{duration(advice['expired_block_seconds'])} in all (block-seconds)"
    )


def audit_command(
    logs: Logs,
    now: Now = None,
    as_json: AsJson = False,
    skip_bad_lines: SkipBad = False,
    fail_on: FailOn = "error",
    transfer_timeout: TransferTimeout = DEFAULT_TRANSFER_TIMEOUT_S,
    clock_skew: ClockSkew = DEFAULT_CLOCK_SKEW_S,
    jobs: Jobs = None,
) -> None:
    """Findings only, at `--now` (default: the last event's ts)."""
    rank = _fail_rank(fail_on)
    config = guarded(lambda: AuditConfig(transfer_timeout_s=transfer_timeout, clock_skew_s=clock_skew))
    answer, skipped = fold(logs, jobs, config, now=now, skip_bad=skip_bad_lines)
    _report_skipped(skipped)
    report_compaction(answer.warning)
    clock, findings = answer.clock, answer.findings
    if as_json:
        sys.stdout.write(json.dumps([msgspec.to_builtins(f) for f in findings]) + "\n")
    elif findings:
        out.print(_findings_table(findings, f"{len(findings)} findings at {utc(clock)}"))
    else:
        out.print(f"no findings at {utc(clock)}")
    _exit_for(findings, rank)


def timeline_command(
    logs: Logs,
    transfer_id: Annotated[str, typer.Argument(help="The transfer id, e.g. tx-0000002a")],
    as_json: AsJson = False,
    skip_bad_lines: SkipBad = False,
) -> None:
    """The story of one transfer: every event on both sides, each decision and why, the gaps."""

    def run() -> Any:
        with Inputs(list(logs), skip_bad_lines=skip_bad_lines) as inputs:
            return build(inputs.events(), transfer_id), inputs.skipped

    timeline, skipped = guarded(run)
    _report_skipped(skipped)
    if not timeline.rows:
        raise _bad_input(f"transfer {transfer_id!r} does not appear in {', '.join(map(str, logs))}")
    if as_json:
        rows = [row.__dict__ for row in timeline.rows]
        sys.stdout.write(json.dumps({"transfer_id": transfer_id, "rows": rows}) + "\n")
        return
    start = timeline.rows[0].ts
    table = Table(title=f"transfer {transfer_id}", title_justify="left")
    for column in ("since first", "gap", "source", "seq", "kind", "what happened"):
        table.add_column(column, overflow="fold")
    for row in timeline.rows:
        style = "bold green" if row.decision and "completed" in row.text else "bold red" if row.decision else ""
        gap = duration(row.gap_s) if row.gap_s else ""
        table.add_row(offset(row.ts - start), gap, row.source, str(row.seq), row.kind, row.text, style=style or None)
    out.print(f"first event at {utc(start)}")
    out.print(table)
    for side in timeline.sides:
        state = "still holding its blocks" if side.live else side.phase
        out.print(f"{side.source}: {side.role or 'never mapped'} side, {state}")
