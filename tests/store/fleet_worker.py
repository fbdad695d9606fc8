"""A partition worker in a process of its own, for tests/store/test_nats_workers.py and
test_sql_fleet_service.py: folds the store's partitions from their source (a NATS stream's durable
consumers, a SQL store's tail) until it has folded everything the store holds, then writes each
partition's answer, digest and counts to `--out`. It prints `saved <partition> <stream seq>` after each save
(flushed), so a test can kill it while it folds; `--crash-after-save N` kills itself (SIGKILL) right after
its N-th save, before that save's acknowledgement. `spawn` starts it; `digest` is the digest a fold of
given events must have, computed apart from the fold."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec

from kvledger.ledger.events import Event
from kvledger.ledger.fleet import PartitionFold, run_worker
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.partition_source import Delivered


def spawn(url: str, partitions: range, out: Path, last_seq: int, now: float, *extra: str) -> subprocess.Popen[str]:
    """This worker over `url`'s `partitions` in a process of its own, its `saved` lines on a pipe."""
    command = [sys.executable, "-m", "tests.store.fleet_worker", url, "--partitions", ",".join(map(str, partitions)),
               "--last-seq", str(last_seq), "--now", str(now), "--out", str(out), *extra]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def digest(events: list[Event]) -> int:
    """The sum, mod 2**64, of `crc32(source) << 32 | seq` over `events`: a fold of them, each once, has it."""
    return sum((zlib.crc32(e.source.encode()) << 32) | e.seq for e in events) & ((1 << 64) - 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--partitions", required=True, help="e.g. 0,1,2,3")
    parser.add_argument("--service", default="test")
    parser.add_argument("--fetch", type=int, default=256)
    parser.add_argument("--snapshot-every-events", type=int, default=1_000_000)
    parser.add_argument("--crash-after-save", type=int, default=0)
    parser.add_argument(
        "--last-seq", type=int, required=True, help="the stream's last sequence (a SQL store's last cursor): stop there"
    )
    parser.add_argument("--now", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    store = open_store(args.url)
    saves = 0
    redelivered = 0

    def after_save(fold: PartitionFold) -> None:
        nonlocal saves
        saves += 1
        print(f"saved {fold.partition} {fold.saved}", flush=True)
        if saves == args.crash_after_save:
            os.kill(os.getpid(), signal.SIGKILL)

    def between(folds: dict[int, PartitionFold], delivered: list[Delivered]) -> bool:
        nonlocal redelivered
        redelivered += sum(d.redelivered for d in delivered)
        return not all(f.upto >= args.last_seq for f in folds.values())

    folds = run_worker(
        store, [int(p) for p in args.partitions.split(",")], service=args.service, between=between,
        keep_releases=True, snapshot_every_events=args.snapshot_every_events, fetch_messages=args.fetch,
        after_save=after_save,
    )  # fmt: skip
    out = {
        p: (msgspec.msgpack.encode(f.answer(args.now, upto=args.last_seq)), f.digest, f.folded.events)
        for p, f in folds.items()
    }
    with open(args.out, "wb") as file:
        restored = {p: f.restored for p, f in folds.items()}
        file.write(msgspec.msgpack.encode({"answers": out, "redelivered": redelivered, "restored": restored}))
    store.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
