"""The replay, audit and timeline commands, through the real console script and Typer's runner."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvledger.cli.app import app
from kvledger.ledger.jsonl import write_log
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.synth import SynthConfig, generate
from tests.ledger.builders import Side

runner = CliRunner()
KVLEDGER = shutil.which("kvledger") or "kvledger"
ROOT = Path(__file__).resolve().parents[2]
CHECKOUT_CLI = [sys.executable, "-m", "kvledger.cli"]
"""The command of this checkout (the console script may run another install's code)."""


def _incident(tmp_path: Path, seed: int = 5, **overrides: object) -> Path:
    cfg = SynthConfig(**{"transfers": 400, "concurrency": 64, "fault_rate": 0.2, **overrides})  # type: ignore[arg-type]
    path = tmp_path / f"incident-{seed}.jsonl"
    write_log(path, generate(cfg, seed=seed))
    return path


def _leaky(tmp_path: Path) -> Path:
    p = Side("prefill-0/tp0", start_ts=1000.0)
    events = [p.map("tx-held", "p-1", deadline=1001.0), p.map("tx-ok", "p-2", blocks=(7,)), p.ack("tx-ok", "release")]
    path = tmp_path / "leak.jsonl"
    write_log(path, events)
    return path


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replay_decisions_equal_the_live_decisions_in_order(tmp_path: Path, seed: int) -> None:
    cfg = SynthConfig(transfers=300, concurrency=48, fault_rate=0.25)
    events = list(generate(cfg, seed=seed))
    live = {source: Ledger(source) for source in (cfg.producer, cfg.consumer)}
    decided = []
    for event in events:
        release = live[event.source].append(event)
        if release is not None:
            decided.append(json.loads(json.dumps(_plain(release))))
    path = tmp_path / "live.jsonl"
    write_log(path, (e for source in live.values() for e in source.log.since(0)))
    result = subprocess.run([KVLEDGER, "replay", str(path), "--json", "--fail-on", "never"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    replayed = json.loads(result.stdout)["decisions"]
    # The written log is grouped by source, so compare each source's decisions in order.
    for source in live:
        assert [d for d in replayed if d["source"] == source] == [d for d in decided if d["source"] == source]
    assert len(replayed) == len(decided) > 0


def _plain(release: object) -> dict[str, object]:
    import msgspec

    return msgspec.to_builtins(release)  # type: ignore[no-any-return]


def test_replay_prints_the_summary_and_exits_by_severity(tmp_path: Path) -> None:
    path = _leaky(tmp_path)
    result = subprocess.run([KVLEDGER, "replay", str(path), "--now", "1005"], capture_output=True, text=True)
    assert result.returncode == 1  # a leak is an error
    assert "blocks still held: 3" in result.stdout
    assert "leak" in result.stdout and "tx-held" in result.stdout
    assert "completed" in result.stdout
    quiet = subprocess.run([KVLEDGER, "replay", str(path), "--now", "1000.5"], capture_output=True, text=True)
    assert quiet.returncode == 0, quiet.stdout  # before the deadline there is no leak yet


def test_times_and_durations_are_written_for_people(tmp_path: Path) -> None:
    """UTC with the zone, durations in units (`4 s`, `10 ms`): never raw epoch seconds or `4.000s`."""
    path = _leaky(tmp_path)
    replay = runner.invoke(app, ["replay", str(path), "--now", "1005"], terminal_width=200)
    assert "audit clock 1970-01-01 00:16:45.000 UTC" in replay.stdout
    assert "3 blocks held 4 s past the deadline" in replay.stdout
    audit = runner.invoke(app, ["audit", str(path), "--now", "1000.5"])
    assert "no findings at 1970-01-01 00:16:40.500 UTC" in audit.stdout
    timeline = runner.invoke(app, ["timeline", str(path), "tx-ok"], terminal_width=200)
    assert "first event at 1970-01-01 00:16:40.020 UTC" in timeline.stdout and "+10 ms" in timeline.stdout
    for text in (replay.stdout, audit.stdout, timeline.stdout):
        assert not re.search(r"\b1000\.\d+|\d\.\d{3}s\b", text), text


def test_replay_json_and_time_travel(tmp_path: Path) -> None:
    path = _leaky(tmp_path)
    full = json.loads(runner.invoke(app, ["replay", str(path), "--json", "--now", "1005"]).stdout)
    assert full["summary"]["blocks_held"] == 3
    assert full["summary"]["findings_by_code"] == {"leak": 1}
    assert [d["transfer_id"] for d in full["decisions"]] == ["tx-ok"]
    early = runner.invoke(app, ["replay", str(path), "--json", "--until-seq", "2", "--now", "1000"])
    assert early.exit_code == 0
    assert json.loads(early.stdout)["decisions"] == []
    assert json.loads(early.stdout)["summary"]["blocks_held"] == 4
    by_ts = runner.invoke(app, ["replay", str(path), "--json", "--until-ts", "1000.015", "--now", "1000"])
    assert json.loads(by_ts.stdout)["events"] == 1


def test_audit_lists_findings_only(tmp_path: Path) -> None:
    path = _leaky(tmp_path)
    result = runner.invoke(app, ["audit", str(path), "--now", "1005", "--json"])
    assert result.exit_code == 1
    assert [f["code"] for f in json.loads(result.stdout)] == ["leak"]
    clean = runner.invoke(app, ["audit", str(path), "--now", "1000.5"])
    assert clean.exit_code == 0 and "no findings" in clean.stdout


def test_timeline_tells_one_transfers_story(tmp_path: Path) -> None:
    path = _incident(tmp_path)
    result = subprocess.run([KVLEDGER, "timeline", str(path), "tx-00000003"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "RELEASE" in result.stdout and "prefill-0/tp0" in result.stdout and "decode-0/tp0" in result.stdout
    missing = runner.invoke(app, ["timeline", str(path), "tx-nope"])
    assert missing.exit_code == 2 and "does not appear" in missing.stderr


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"format":"kvledger","version":1}\n{"kind":"seal","seq":1,"ts":1,"source":"p","transfer_id":"t","expected":1}\n{"kind":"se',
         ":3: truncated last line"),
        (b'{"format":"nope","version":1}\n', ":1: field 'format'"),
        (b'{"format":"kvledger","version":9}\n', ":1: field 'version': unknown version 9"),
    ],
)  # fmt: skip
def test_bad_logs_exit_2_with_one_line_naming_file_and_line(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    result = subprocess.run([KVLEDGER, "replay", str(path)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stdout == ""  # nothing printed as if it had succeeded
    assert result.stderr.startswith("kvledger: error: ") and str(path) in result.stderr and needle in result.stderr


def test_missing_file_and_overlapping_logs_exit_2(tmp_path: Path) -> None:
    missing = subprocess.run([KVLEDGER, "replay", str(tmp_path / "gone.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    path = _incident(tmp_path)
    copy = tmp_path / "copy.jsonl"
    shutil.copy(path, copy)
    twice = subprocess.run([KVLEDGER, "replay", str(path), str(copy)], capture_output=True, text=True)
    assert twice.returncode == 2 and "overlap" in twice.stderr and twice.stdout == ""


def test_skip_bad_lines_reports_what_it_skipped(tmp_path: Path) -> None:
    path = _leaky(tmp_path)
    with path.open("ab") as f:
        f.write(b'{"kind":"ack","seq":"x"}\n')
    result = runner.invoke(app, ["replay", str(path), "--skip-bad-lines", "--json", "--fail-on", "never"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["skipped"][0]["line"] == 5
    assert "skipped" in result.stderr


def test_merging_producer_and_consumer_logs_finds_a_premature_release(tmp_path: Path) -> None:
    p, c = Side("prefill-0/tp0", start_ts=1000.0), Side("decode-0/tp0", start_ts=1000.0)
    write_log(tmp_path / "p.jsonl", [p.map("tx", "p-1", deadline=1001.0), p.expire("tx", ts=1001.0)])
    write_log(tmp_path / "c.jsonl", [c.map("tx", "c-1", "consumer", remote=(1, 2, 3)), c.schedule("tx"),
                                      c.ack("tx", "read", ts=1004.0)])  # fmt: skip
    result = runner.invoke(app, ["audit", str(tmp_path / "p.jsonl"), str(tmp_path / "c.jsonl"), "--json"])
    assert result.exit_code == 1
    assert [f["code"] for f in json.loads(result.stdout)] == ["premature_release"]


def _checkout_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*CHECKOUT_CLI, *args], input=stdin, capture_output=True, cwd=ROOT, env=env, timeout=120)


def test_a_pipe_is_read_as_a_log(tmp_path: Path) -> None:
    """`cat log | kvledger replay /dev/stdin` once said "empty file": the SQLite sniff ate the pipe's start."""
    path = _incident(tmp_path)
    result = _checkout_cli("replay", "/dev/stdin", "--json", "--fail-on", "never", stdin=path.read_bytes())
    assert result.returncode == 0, result.stderr
    whole = runner.invoke(app, ["replay", str(path), "--json", "--fail-on", "never"])
    assert json.loads(result.stdout)["events"] == json.loads(whole.stdout)["events"] > 0


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"format":"kvledger","version":1,"meta":{"x":' + b"[" * 1000 + b"]" * 1000 + b"}}\n",
         ":1: not a kvledger header (nested too deep: more than 64 levels)"),
        (b'{"format":"kvledger","version":1}\n{"kind":"ack","seq":1,"ts":1,"source":"p","transfer_id":"t","what":"recv","rank":36893488147419103232}\n',
         ":2: field 'rank': integer 36893488147419103232 does not fit in 64 bits"),
    ],
    ids=["header nested 1000 deep", "integer past 64 bits"],
)  # fmt: skip
def test_hostile_logs_exit_2_naming_file_and_line(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(content)
    result = _checkout_cli("replay", str(path))
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode().startswith(f"kvledger: error: {path}{needle}"), result.stderr


def test_a_log_the_fold_once_crashed_on_replays_with_its_findings(tmp_path: Path) -> None:
    """A map naming a block twice, two more claimants, then the first expired: replay exited 2 without a line."""
    p = Side("prefill-0/tp0", start_ts=1000.0)
    path = tmp_path / "poison.jsonl"
    write_log(path, [p.map("a", "ra", blocks=(2, 2)), p.map("b", "rb", blocks=(2,)), p.map("c", "rc", blocks=(2,)),
                     p.expire("a")])  # fmt: skip
    result = runner.invoke(app, ["audit", str(path), "--json", "--now", "1001"])
    assert result.exit_code == 0, result.output
    assert "duplicate" in [f["code"] for f in json.loads(result.stdout)]  # the repeated block is evidence
