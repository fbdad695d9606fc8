"""Offline replay throughput and peak memory on generated incident logs (1M and 10M events).

Run: python benchmarks/replay.py [--events N] [--dir DIR]. The log is generated here (never
committed). Baselines in the same run: decoding the same file with msgspec alone, to show
what fraction of replay time goes to folding, and decoding the 1M log's events as msgpack
(`decode_only_msgpack_events_per_s`, the store's encoding): what a replay's decoding costs at
its cheapest. Peak memory is measured in a fresh child process per log size (ru_maxrss), so
1M and 10M are comparable. On the large log, `kvledger replay`'s fold and audit with `--jobs` 1, 2, 4
and the machine's cores (`events_per_s_jobs_N`, in this process: the command's work less its start
and printing; each N's best of `--rounds` tries taken in turn), the CPU they spent over 1 job's
(`cpu_ratio_jobs_N`), `speedup_max` (the best N over 1 job, same run) and `same_output` (every N's summary,
advice and findings equal 1 job's). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

from benchmarks.quick import parse_args
from kvledger.ledger.events import Event
from kvledger.ledger.jsonl import header_line, read_chunks, read_events
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.synth import SynthConfig, generate

EVENTS_PER_TRANSFER = 13
"""About how many events (both sides) the generator makes per transfer with these settings."""
CHUNK = 100_000


FIELDS: tuple[str, ...] = (
    "events_1m",
    "peak_mb_1m",
    "sides_in_memory_1m",
    "decode_only_msgpack_events_per_s",
    "events_10m",
    "peak_mb_10m",
    "sides_in_memory_10m",
    "events_per_s",
    "decode_only_events_per_s",
    "fold_fraction",
    "events_per_s_jobs_1",
    "events_per_s_jobs_2",
    "events_per_s_jobs_4",
    "events_per_s_jobs_cores",
    "cores",
    "cpu_ratio_jobs_1",
    "cpu_ratio_jobs_2",
    "cpu_ratio_jobs_4",
    "cpu_ratio_jobs_cores",
    "speedup_max",
    "same_output",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""


def make_log(path: Path, events: int, seed: int) -> int:
    cfg = SynthConfig(
        transfers=max(1, events // EVENTS_PER_TRANSFER), concurrency=512, layers=64, layers_per_step=8, fault_rate=0.0
    )
    encoder = msgspec.json.Encoder()
    n = 0
    with path.open("wb") as f:
        f.write(header_line(source=None, generator="benchmarks/replay.py", seed=seed))
        chunk: list[Event] = []
        for event in generate(cfg, seed=seed):
            chunk.append(event)
            if len(chunk) == CHUNK:
                f.write(encoder.encode_lines(chunk))
                n += len(chunk)
                chunk.clear()
        f.write(encoder.encode_lines(chunk))
        n += len(chunk)
    return n


def decode_only(path: Path) -> tuple[int, float]:
    start = time.perf_counter()
    n = sum(1 for _ in read_events(path))
    return n, time.perf_counter() - start


def decode_only_msgpack(path: Path) -> tuple[int, float]:
    """The same events as msgpack (the store's encoding of a body), decoded in lists of CHUNK by msgspec: the
    other decoding a replay has, timed alone (only the decoding; the encoding is made before)."""
    encode = msgspec.msgpack.Encoder().encode
    chunks = [encode(chunk) for chunk in read_chunks(path)]
    decode = msgspec.msgpack.Decoder(list[Event]).decode
    start = time.perf_counter()
    n = sum(len(decode(chunk)) for chunk in chunks)
    return n, time.perf_counter() - start


def fold(path: Path) -> dict[str, float]:
    """Replay in this process; report throughput, live sides at the end and peak RSS."""
    start = time.perf_counter()
    result = replay_chunks(read_chunks(path), keep_releases=False)
    elapsed = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "events": result.events,
        "seconds": elapsed,
        "releases": result.release_count,
        "sides_in_memory": len(result.state.transfers),
        "peak_mb": peak_kb / 1024,
    }


def jobs_figures(path: Path, events: int, rounds: int) -> dict[str, object]:
    """`kvledger replay`'s fold and audit of `path` (kvledger.cli.replay.fold) with --jobs 1, 2, 4 and the cores,
    `rounds` times each in turn (1, 2, 4, cores, 1, 2, ...): each N's best wall time, so a burst of another
    job on a shared machine slows one try, not one N. Beside each, the CPU seconds its processes spent (the
    parent's and the workers'), best of the rounds: `cpu_ratio_jobs_N`, N jobs' CPU over 1 job's, is what
    partitioning costs in work whatever the machine's load."""
    from kvledger.cli.jobs import cores
    from kvledger.cli.replay import fold as fold_jobs
    from kvledger.ledger.advice import timeout_advice
    from kvledger.ledger.audit import AuditConfig
    from kvledger.ledger.summary import summarize_counts

    config = AuditConfig()
    figures: dict[str, object] = {"cores": cores()}
    outputs: dict[int, object] = {}
    best_s: dict[int, float] = {}
    best_cpu_s: dict[int, float] = {}
    counts = dict.fromkeys((1, 2, 4, cores()))
    for _ in range(rounds):
        for jobs in counts:
            cpu_before = _cpu_s()
            start = time.perf_counter()
            answer, _ = fold_jobs([path], jobs, config, now=None, skip_bad=False)
            elapsed = time.perf_counter() - start
            cpu = _cpu_s() - cpu_before
            assert answer.events == events
            best_s[jobs] = min(best_s.get(jobs, elapsed), elapsed)
            best_cpu_s[jobs] = min(best_cpu_s.get(jobs, cpu), cpu)
            outputs.setdefault(jobs, (
                answer.events, answer.clock, summarize_counts(answer.counts, answer.findings),
                timeout_advice(answer.latencies), answer.findings,
            ))  # fmt: skip
            print(f"--jobs {jobs}: {events / elapsed:,.0f} ev/s, {cpu:.1f} CPU s")
    for label, jobs in (("1", 1), ("2", 2), ("4", 4), ("cores", cores())):
        figures[f"events_per_s_jobs_{label}"] = round(events / best_s[jobs])
        figures[f"cpu_ratio_jobs_{label}"] = round(best_cpu_s[jobs] / best_cpu_s[1], 2)
    figures["speedup_max"] = round(best_s[1] / min(best_s.values()), 2)
    figures["same_output"] = all(output == outputs[1] for output in outputs.values())
    return figures


def _cpu_s() -> float:
    """CPU seconds of this process and its waited-for children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def in_child(flag: str, path: Path) -> dict[str, float]:
    """`fold` (--child-fold) or `decode_only_msgpack` (--child-msgpack) of `path` in a fresh process: a child
    starts with the peak memory of the process it was forked from (ru_maxrss survives exec)."""
    out = subprocess.run([sys.executable, __file__, flag, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=10_000_000, help="size of the large log")
    parser.add_argument("--small", type=int, default=1_000_000, help="size of the small log")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the logs (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=3, help="tries of each --jobs count, taken in turn (best kept)")
    parser.add_argument("--child-fold", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-msgpack", type=Path, default=None, help=argparse.SUPPRESS)
    args = parse_args(parser, events=4_000, small=2_000, rounds=1)
    if args.child_fold is not None:
        print(json.dumps(fold(args.child_fold)))
        return
    if args.child_msgpack is not None:
        events, seconds = decode_only_msgpack(args.child_msgpack)
        print(json.dumps({"events": events, "seconds": seconds}))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        figures: dict[str, object] = {}
        for label, size in (("1m", args.small), ("10m", args.events)):
            path = Path(tmp) / f"incident-{label}.jsonl"
            start = time.perf_counter()
            n = make_log(path, size, args.seed)
            made_s = time.perf_counter() - start
            decoded, decode_s = decode_only(path)
            child = in_child("--child-fold", path)
            assert child["events"] == decoded == n
            print(
                f"{label}: {n:,} events ({path.stat().st_size / 1e6:,.0f} MB, made in {made_s:.1f}s); "
                f"replay {n / child['seconds']:,.0f} ev/s; decode only {n / decode_s:,.0f} ev/s; "
                f"peak {child['peak_mb']:.0f} MB; {child['sides_in_memory']:,.0f} sides kept in memory"
            )
            figures[f"events_{label}"] = n
            figures[f"peak_mb_{label}"] = round(child["peak_mb"], 1)
            figures[f"sides_in_memory_{label}"] = child["sides_in_memory"]
            if label == "1m":
                msgpack = in_child("--child-msgpack", path)  # its copies would raise the next child's peak
                assert msgpack["events"] == n
                figures["decode_only_msgpack_events_per_s"] = round(n / msgpack["seconds"])
            if label == "10m":
                figures["events_per_s"] = round(n / child["seconds"])
                figures["decode_only_events_per_s"] = round(n / decode_s)
                figures["fold_fraction"] = round(1 - decode_s / child["seconds"], 3)
                figures.update(jobs_figures(path, n, args.rounds))
            os.unlink(path)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
