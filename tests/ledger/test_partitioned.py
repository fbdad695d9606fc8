"""A log folded in partitions and merged gives exactly the one-fold answer, in the same order: generated
histories (every fault kind, block ids colliding within a source, reused ids, forged-message drops)
split 1 to 8 ways by `partition_of`, in one process (`fold_partition`, `merge`) and through the CLI's
`--jobs` processes."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvledger.cli.app import app
from kvledger.ledger.advice import timeout_advice
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Drop, Event, TransferId
from kvledger.ledger.jsonl import write_log
from kvledger.ledger.limits import ID_WINDOW_S
from kvledger.ledger.merge import batched
from kvledger.ledger.partition import partition_of, partition_of_event
from kvledger.ledger.partitioned import Batch, Merger, answer, fold_partition, merge, slices
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.summary import state_counts
from tests.ledger.histories import Shape, audit_moments, history

SHAPES = st.sampled_from([
    Shape(transfers=40, span_s=120.0, block_pool=6),
    Shape(transfers=30, span_s=60.0, faults_per_side=3.0, reuse_rate=0.3, orphan_rate=0.15, block_pool=4,
          consumers=("decode-0/tp0", "decode-1/tp0")),
])  # fmt: skip


def _with_drops(events: list[Event], seed: int) -> list[Event]:
    """A few forged-message drops among the events (they name no side: partition 0 folds them all)."""
    rng = random.Random(seed)
    out = list(events)
    seq = {e.source: 0 for e in events}
    for e in events:
        seq[e.source] = max(seq[e.source], e.seq)
    for i in range(5):
        at = rng.randrange(len(out) + 1)
        source = rng.choice(sorted(seq))
        seq[source] += 1
        ts = out[min(at, len(out) - 1)].ts
        out.insert(at, Drop(seq=seq[source], ts=ts, source=source, transfer_id=TransferId(f"tx-forged-{i}"),
                            message="release", sender="10.0.0.9:1", reason="bad_mac"))  # fmt: skip
    return out


def _one_fold(events: list[Event], now: float, compact_every: int = 128) -> tuple[object, ...]:
    result = replay_chunks(batched(events, 64), compact_every=compact_every)
    advice = timeout_advice(result.latencies)
    return result.releases, audit(result.state, now), state_counts(result.state), advice, result.events


def _partitioned(events: list[Event], jobs: int, now: float, compact_every: int = 128) -> tuple[object, ...]:
    """Each partition folded alone, emitting small batches as it goes; the batches fed to the merge
    interleaved as a parent receives them (round robin here), then the answers in reverse order."""
    batches: list[list[Batch]] = [[] for _ in range(jobs)]
    answers = []
    for p in range(jobs):
        folded = fold_partition(
            slices(batched(events, 64), p, jobs), p, jobs, compact_every=compact_every, emit=batches[p].append,
            batch_items=16,
        )  # fmt: skip
        answers.append(answer(folded, now))
    as_sent = [msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=type(a)) for a in answers]
    merger = Merger(jobs)
    for round_ in itertools.zip_longest(*batches):
        for p, batch in enumerate(round_):
            if batch is not None:
                merger.add(p, msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=Batch))
    merged = merger.finish(list(reversed(as_sent)))
    return merged.releases, merged.findings, merged.counts, timeout_advice(merged.latencies), merged.events


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), shape=SHAPES)
def test_every_partitioning_merges_into_the_one_fold_answer(seed: int, shape: Shape) -> None:
    note(f"history({seed}, {shape!r})")
    events = _with_drops(history(seed, shape), seed)
    for now in [events[-1].ts, *audit_moments(events, random.Random(seed), count=2)]:
        expected = _one_fold(events, now)
        assert expected[1], "the history has findings"
        for jobs in range(1, 9):
            assert _partitioned(events, jobs, now) == expected, (jobs, now)


def test_partitions_split_by_transfer_and_drops_go_to_partition_0() -> None:
    events = history(7, Shape(transfers=20))
    for e in events:
        assert partition_of_event(e, 4) == partition_of(e.transfer_id, 4)
    tid = next(TransferId(f"tx-{i}") for i in range(100) if partition_of(f"tx-{i}", 4) != 0)
    drop = Drop(seq=1, ts=1.0, source="a", transfer_id=tid, message="m", sender="s", reason="r")
    assert partition_of_event(drop, 4) == 0
    with pytest.raises(ValueError, match="not each of range"):
        merge([answer(fold_partition(slices([events], 0, 2), 0, 2), 0.0)])


def test_double_owner_across_partitions_is_found_by_the_ownership_projection() -> None:
    """Two live sides of one source claiming one block, their ids in different partitions."""
    from tests.ledger.builders import Side

    p = Side("prefill-0/tp0")
    a, b = "tx-a", next(f"tx-{i}" for i in range(100) if partition_of(f"tx-{i}", 2) != partition_of("tx-a", 2))
    events: list[Event] = [p.map(a, "p-a", blocks=(1, 2)), p.map(b, "p-b", blocks=(2, 3))]
    now = events[-1].ts
    expected = _one_fold(events, now)
    assert [f.code for f in expected[1]] == ["double_owner"]  # type: ignore[attr-defined]
    assert _partitioned(events, 2, now) == expected


STAMPED = Shape(
    transfers=300, span_s=10 * ID_WINDOW_S, late_gap_s=1.5 * ID_WINDOW_S, faults_per_side=2.0, reuse_rate=0.3,
    orphan_rate=0.15, premature_rate=0.3, block_pool=4, stamped_rate=0.5, issue_lead_s=5.0,
)  # fmt: skip
"""Ten id windows: stamped ids reused and late inside and past their window, tombstones retired by time."""


@pytest.mark.parametrize("seed", [3, 4])
def test_retirement_by_time_is_the_same_in_every_partition(seed: int) -> None:
    """Each partition retires stamped ids at the whole stream's clock (its cut), never its own: the merged
    answer, the compaction counts (tombstones held after retirement) included, is one fold's."""
    events = _with_drops(history(seed, STAMPED), seed)
    whole = replay_chunks(batched(events, 64), compact_every=64).state
    assert sum(whole.compacted_by_phase.values()) > whole.tombstone_count, "tombstones were retired"
    assert whole.past_window and whole.behind_horizon == 0, "rule S judged events past their window"
    held = [*whole.tombstones, *whole.orphan_tombstones]
    for jobs in (2, 3):
        for p in range(jobs):
            state = fold_partition(slices(batched(events, 64), p, jobs), p, jobs, compact_every=64).state
            assert state.retired_through == whole.retired_through, (p, jobs)
            mine = sorted(k for k in held if partition_of(k[1], jobs) == p)
            assert sorted([*state.tombstones, *state.orphan_tombstones]) == mine, (p, jobs)
    for now in [events[-1].ts, *audit_moments(events, random.Random(seed), count=1)]:
        expected = _one_fold(events, now, compact_every=64)
        assert expected[2]["compaction"]["tombstones"] == whole.tombstone_count  # type: ignore[index]
        for jobs in (2, 3, 5):
            assert _partitioned(events, jobs, now, compact_every=64) == expected, (jobs, now)


def test_the_cli_with_jobs_prints_what_one_job_prints(tmp_path: Path) -> None:
    """Both ways a worker reads: one JSONL log split line by line, and (with --skip-bad-lines) decoded
    whole; text and JSON; replay and audit; and a bad line fails as in one process."""
    from typer.testing import CliRunner

    events = _with_drops(history(11, Shape(transfers=60, span_s=120.0, block_pool=6, faults_per_side=2.5)), 11)
    log = tmp_path / "incident.jsonl"
    write_log(log, events)
    runner = CliRunner()
    outputs = {}
    for command in ("replay", "audit"):
        for flags in ([], ["--json"], ["--json", "--skip-bad-lines"]):
            for jobs in (1, 3):
                args = [command, str(log), *flags, "--fail-on", "never", "--jobs", str(jobs)]
                result = runner.invoke(app, args)
                assert result.exit_code == 0, result.output
                outputs[(command, *flags, jobs)] = result.stdout
            assert outputs[(command, *flags, 3)] == outputs[(command, *flags, 1)], (command, flags)
    assert json.loads(outputs[("replay", "--json", 1)])["decisions"] and json.loads(outputs[("audit", "--json", 1)])
    lines = log.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join([*lines[:40], b'{"kind":"ack","ts":-1}\n', *lines[40:70], b"{not json\n", *lines[70:]]))
    errors = set()
    for jobs in (1, 2, 3):
        result = runner.invoke(app, ["audit", str(bad), "--jobs", str(jobs)])
        assert result.exit_code == 2
        errors.add(result.stderr)
    assert len(errors) == 1 and f"{bad}:41:" in errors.pop()
    result = runner.invoke(app, ["audit", str(log), "--jobs", "0"])
    assert result.exit_code == 2 and "--jobs: must be at least 1, got 0" in result.stderr


def test_several_logs_merged_by_time_print_the_same_with_jobs(tmp_path: Path) -> None:
    """Each worker merges the sources' logs itself, decoding them whole, and keeps its partition."""
    from typer.testing import CliRunner

    events = _with_drops(history(13, Shape(transfers=50, span_s=90.0, block_pool=5, faults_per_side=2.0)), 13)
    paths = []
    for source in sorted({e.source for e in events}):
        path = tmp_path / f"{source.replace('/', '-')}.jsonl"
        write_log(path, sorted((e for e in events if e.source == source), key=lambda e: e.seq))
        paths.append(str(path))
    assert len(paths) > 2
    runner = CliRunner()
    printed = {}
    for jobs in (1, 2, 5):
        result = runner.invoke(app, ["replay", *paths, "--json", "--fail-on", "never", "--jobs", str(jobs)])
        assert result.exit_code == 0, result.output
        printed[jobs] = result.stdout
    assert printed[2] == printed[1] and printed[5] == printed[1]
    assert json.loads(printed[1])["findings"]


def _tricky(events: list[Event]) -> bytes:
    """A log's lines with what `split_lines` must not take at its word: blank lines, escapes, a drop,
    an id that is also another field's value, keys in another order and with spaces, keys twice."""
    lines = write_lines(events)
    out = [lines[0], b"\n", b"  \t\r\n"]
    for k, line in enumerate(lines[1:], 1):
        if k % 7 == 0:
            record = json.loads(line)
            line = (json.dumps(dict(reversed(list(record.items())))) + "\n").encode()  # spaces after ':'
        elif k % 11 == 0:
            line = line.replace(b'"source":"', b'"source":"\\u0070', 1) if b'"source":"p' in line else line
        elif k % 13 == 0:
            line = line.replace(b'"request_id":"', b'"request_id":"ts', 1)
        elif k % 19 == 0:  # keys twice: msgspec takes the last, so the first must not decide the partition
            line = line.replace(b"{", b'{"transfer_id":"tx-decoy","ts":1.0,', 1)
        out.append(line)
        if k % 17 == 0:
            out.append(b"\n")
    return b"".join(out)


def write_lines(events: list[Event]) -> list[bytes]:
    from kvledger.ledger.jsonl import header_line

    return [header_line(), *(msgspec.json.encode(e) + b"\n" for e in events)]


def test_a_log_split_by_its_lines_is_what_decoding_it_whole_and_filtering_gives(tmp_path: Path) -> None:
    from kvledger.ledger.jsonl import open_log, read_chunks

    events = _with_drops(history(5, Shape(transfers=50, span_s=60.0, faults_per_side=2.0)), 5)
    log = tmp_path / "tricky.jsonl"
    log.write_bytes(_tricky(events))
    for partitions in (1, 2, 3, 5):
        for partition in range(partitions):
            reader = open_log(log)
            try:
                split = list(reader.partition_chunks(partition, partitions))
            finally:
                reader._stream.close()
            decoded = list(slices(read_chunks(log), partition, partitions))
            assert split == decoded, (partition, partitions)
            assert sum(len(s[0]) for s in split) < len(events) or partitions == 1


def test_split_lines_is_the_same_compiled_and_interpreted(tmp_path: Path) -> None:
    """The compiled loop over the bytes and the same source interpreted split a tricky log alike."""
    import os
    import subprocess
    import sys

    from kvledger.ledger.compiled import INTERPRETED_ENV, compiled

    if not compiled():
        pytest.skip("one build only here")
    events = _with_drops(history(9, Shape(transfers=40, span_s=60.0, faults_per_side=2.0)), 9)
    log = tmp_path / "tricky.jsonl"
    log.write_bytes(_tricky(events))
    script = (
        "import sys, json; from kvledger.ledger.jsonl import split_lines; "
        "body = open(sys.argv[1], 'rb').read().split(b'\\n', 1)[1]; "
        "print(json.dumps([repr(split_lines(body, p, 3)) for p in range(3)]))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, INTERPRETED_ENV: "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", script, str(log)], env=env, capture_output=True, text=True, check=True)
    from kvledger.ledger.jsonl import split_lines

    body = log.read_bytes().split(b"\n", 1)[1]
    assert json.loads(run.stdout) == [repr(split_lines(body, p, 3)) for p in range(3)]


def test_without_jobs_a_large_log_is_folded_on_every_core_and_a_small_one_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--jobs` left out: the cores for logs of JOBS_AUTO_BYTES or more (here lowered to this log's size), 1
    below it or for what is not a regular file; the output is the same either way."""
    from typer.testing import CliRunner

    from kvledger.cli import jobs as jobs_module

    events = history(5, Shape(transfers=40, span_s=60.0, block_pool=6, faults_per_side=1.5))
    log = tmp_path / "incident.jsonl"
    write_log(log, events)
    size = log.stat().st_size
    assert jobs_module.default_jobs([log]) == 1
    assert jobs_module.default_jobs([tmp_path / "missing.jsonl"]) == 1
    monkeypatch.setattr(jobs_module, "JOBS_AUTO_BYTES", size)
    monkeypatch.setattr(jobs_module, "cores", lambda: 3)
    assert jobs_module.default_jobs([log]) == 3
    assert jobs_module.default_jobs([tmp_path]) == 1  # a folder is no regular file: one process names the error
    folded: list[int] = []
    fold_jobs = jobs_module.fold_jobs

    def counted(logs: list[Path], n: int, **kwargs: Any) -> Any:
        folded.append(n)
        return fold_jobs(logs, n, **kwargs)

    monkeypatch.setattr(jobs_module, "fold_jobs", counted)
    runner = CliRunner()
    auto = runner.invoke(app, ["replay", str(log), "--json", "--fail-on", "never"])
    one = runner.invoke(app, ["replay", str(log), "--json", "--fail-on", "never", "--jobs", "1"])
    assert auto.exit_code == one.exit_code == 0, auto.output
    assert folded == [3] and auto.stdout == one.stdout


def test_marks_made_by_other_readers_split_a_log_as_a_readers_own_do(tmp_path: Path) -> None:
    """`--jobs`' workers each mark every N-th chunk of a log (`marked_chunks`) and fold from everyone's marks:
    the same slices as a reader that marks every chunk itself, over a log of many chunks. Marks that do not
    fit the log fail it, naming it; a reader given an end reads no further."""
    from kvledger.ledger.jsonl import open_log
    from kvledger.ledger.limits import JSONL_CHUNK_BYTES

    events = _with_drops(history(3, Shape(transfers=900, span_s=300.0, faults_per_side=1.0)), 3)
    log = tmp_path / "tricky.jsonl"
    log.write_bytes(_tricky(events))
    assert log.stat().st_size > 3 * JSONL_CHUNK_BYTES

    def read(method: str, *args: Any, end: int | None = None, **kwargs: Any) -> list[Any]:
        reader = open_log(log, end=end)
        try:
            return list(getattr(reader, method)(*args, **kwargs))
        finally:
            reader._stream.close()

    for partitions in (2, 3):
        made = [read("marked_chunks", partitions, stride=partitions, first=w) for w in range(partitions)]
        told = [made[k % partitions][k // partitions] for k in range(sum(map(len, made)))]
        assert len(told) > partitions
        for partition in range(partitions):
            own = read("partition_chunks", partition, partitions)
            assert read("partition_chunks", partition, partitions, told) == own, (partition, partitions)
    wrong = [(told[0][0] - 1, told[0][1]), *told[1:]]
    with pytest.raises(ValueError, match=f"{log}: the log changed while it was read"):
        read("partition_chunks", 0, 3, wrong)
    lines = log.read_bytes().splitlines(keepends=True)
    end = sum(map(len, lines[:101]))
    assert len(read("__iter__", end=end)) == sum(1 for line in lines[1:101] if line.strip())
