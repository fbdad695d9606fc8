"""A fleet's ledger on NATS JetStream: E engines publishing through the real writer, partition workers folding.

(a) publish: E engine processes (default 8) each append simulated P/D traffic (`kvledger.ledger.synth`, a
    producer and a consumer source per engine, transfer numbers apart) to per-source `EventLog`s whose
    `BackgroundWriter` publishes to a `nats://` store; timed from a common start until every writer has
    flushed (`publish_events_per_s`). Baseline in the same run: the same E processes publishing the same
    batches (`WRITER_BATCH_EVENTS_MAX` events, split by (partition, source) into messages with the same
    subjects, headers and msgpack bodies, encoded before the clock starts) with nats-py alone
    (`raw_nats_events_per_s`): every message of a batch in flight at once, then its acknowledgements, as
    the store does. `publish_ratio` = store / raw; each the best of `--rounds`, taken in turn.
(b) consume: the stream (a) wrote, folded by 1 worker process owning every partition and by P processes
    (default: the cores) owning a share each, each worker a `kvledger.ledger.fleet.run_worker` over its
    partitions' durable consumers (`consume_events_per_s_1`, `consume_events_per_s_p`, timed from the
    first worker's start until the last has folded the stream; `consume_speedup` = P over 1). The P
    workers' answers, merged (`kvledger.ledger.partitioned.merge`), against one fold of the stream as
    exported (`replay_chunks`): `same_findings`; `lost` and `duplicated` count events appended but not
    stored, stored twice, and stored but not folded or folded twice (each worker's count and digest of
    (source, seq) against the stream's).
(c) service: `kvledger serve --db nats://... --partitions all --workers P` over a fresh stream while the E
    engines append at `--load` (0.5) of capacity (the lesser of (a)'s and (b)'s one-process rates, each
    measured alone: on a machine the engines share with the service, less is left) for `--seconds`;
    a probe appends a leaked transfer every 100 ms and this process polls `GET /audit?code=leak` every
    20 ms: `lag_p99_s` from a probe's append to the first audit listing it, `audit_p99_ms` and
    `audit_max_ms` of those GETs. A probe never seen within `GRACE_S` of the load's end counts as that long
    and in `probes_unseen`. Then the same over `kvledger serve` folding the stream in one process
    (`*_one_process`).
Uses the NATS at --nats (default `KVLEDGER_TEST_NATS_URL` or nats://127.0.0.1:4222; streams of its own,
deleted at the end). Prints one JSON line last.
Usage: python benchmarks/fleet.py [--engines 8] [--workers P] [--events-per-engine N] [--seconds S] [--load 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

import msgspec

from benchmarks.quick import parse_args
from kvledger.cli.jobs import cores
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event, Map, ReqId, TransferId, to_msgpack
from kvledger.ledger.log import EventLog
from kvledger.ledger.merge import batched
from kvledger.ledger.partition import partition_of
from kvledger.ledger.partitioned import PartitionAnswer, merge
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.limits import WRITER_BATCH_EVENTS_MAX
from kvledger.ledger.store.nats_store import H_COUNT, H_FIRST, H_LAST, H_SOURCE, MSG_ID, NatsStore, msg_id
from kvledger.ledger.store.writer import BackgroundWriter
from kvledger.ledger.synth import SynthConfig, generate

FIELDS: tuple[str, ...] = (
    "engines",
    "events",
    "partitions",
    "workers",
    "publish_events_per_s",
    "raw_nats_events_per_s",
    "publish_ratio",
    "consume_events_per_s_1",
    "consume_events_per_s_p",
    "consume_speedup",
    "lost",
    "duplicated",
    "same_findings",
    "service_load",
    "service_events_per_s",
    "lag_p50_s",
    "lag_p99_s",
    "audit_p99_ms",
    "audit_max_ms",
    "probes_unseen",
    "lag_p99_s_one_process",
    "audit_p99_ms_one_process",
    "audit_max_ms_one_process",
    "probes_unseen_one_process",
    "load_avg_1m",
)
"""Every field of the JSON line this benchmark ends with (tests/test_benchmarks_quick.py checks them)."""

PARTITIONS = 16
PROBE_EVERY_S = 0.1
POLL_EVERY_S = 0.02
GRACE_S = 10.0
"""How long after the load a probe may still become visible before it counts as unseen."""
DIGEST_MASK = (1 << 64) - 1


def engine_events(engine: int, events: int, clock_start: float = 1_700_000_000.0) -> list[Event]:
    """Engine `engine`'s traffic: a producer and a consumer source of its own, transfer numbers apart."""
    cfg = SynthConfig(
        transfers=events // 6 + 1, producer=f"prefill-{engine}/tp0", consumer=f"decode-{engine}/tp0",
        seq_assigned=False, first_transfer=engine * 10_000_000, clock_start=clock_start,
    )  # fmt: skip
    return list(generate(cfg, seed=engine))[:events]


def _digest(events: list[Event]) -> int:
    crc: dict[str, int] = {}
    total = 0
    for e in events:
        c = crc.get(e.source)
        if c is None:
            c = crc[e.source] = zlib.crc32(e.source.encode())
        total += (c << 32) | e.seq
    return total & DIGEST_MASK


# -- (a) publish ---------------------------------------------------------------------------------------------


def _append_all(url: str, events: list[Event], spill: str, rate: float | None, stop_at: float | None) -> int:
    """`events` appended through per-source logs to a writer on the store at `url` (at `rate` events/s where
    given, until `stop_at`); returns how many were appended. The writer has flushed when it returns."""
    store = open_store(url)
    writer = BackgroundWriter(store, spill, queue_events_max=max(len(events), 1)).start()
    logs: dict[str, EventLog] = {}
    started = time.perf_counter()
    n = 0
    for n, event in enumerate(events, 1):
        log = logs.get(event.source)
        if log is None:
            log = logs[event.source] = EventLog(event.source)
            log.subscribe(writer.put)
        log.append(event)
        if rate is not None and n % 50 == 0:
            ahead = n / rate - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)
            if stop_at is not None and time.time() >= stop_at:
                break
    assert writer.close(timeout=600), writer.stats()
    stats = writer.stats()
    assert stats["dropped"] == 0 and stats["spilled"] == 0, stats
    store.close()
    return n


def _engine(conn: Connection, url: str, engine: int, events: int, spill: str, start: Any) -> None:
    mine = engine_events(engine, events)
    start.wait()
    began = time.time()
    _append_all(url, mine, spill, None, None)
    conn.send((began, time.time(), len(mine)))


def _raw_messages(events: list[Event], partitions: int, stream: str) -> list[list[tuple[str, bytes, dict[str, str]]]]:
    """The messages the store would publish for `events` in writer-sized batches (seqs as the logs give)."""
    from kvledger.ledger.store.nats_stream import source_token

    seqs: dict[str, int] = {}
    batches = []
    encoder = msgspec.msgpack.Encoder()
    for chunk in batched(events, WRITER_BATCH_EVENTS_MAX):
        groups: dict[tuple[int, str], list[Event]] = {}
        for e in chunk:
            seq = seqs[e.source] = seqs.get(e.source, 0) + 1
            e = msgspec.structs.replace(e, seq=seq)
            groups.setdefault((partition_of(e.transfer_id, partitions), e.source), []).append(e)
        messages = []
        for (partition, source), members in groups.items():
            for first in range(0, len(members), 1_000):
                part = members[first : first + 1_000]
                headers = {
                    MSG_ID: msg_id(source, part[0].seq, part[-1].seq), H_SOURCE: source,
                    H_FIRST: str(part[0].seq), H_LAST: str(part[-1].seq), H_COUNT: str(len(part)),
                }  # fmt: skip
                body = encoder.encode([msgspec.Raw(to_msgpack(e)) for e in part])
                messages.append((f"{stream}.ev.{partition}.{source_token(source)}", body, headers))
        batches.append(messages)
    return batches


def _raw_engine(conn: Connection, servers: str, stream: str, engine: int, events: int, start: Any) -> None:
    import nats

    batches = _raw_messages(engine_events(engine, events), PARTITIONS, stream)

    async def publish() -> float:
        nc = await nats.connect(servers)
        js = nc.jetstream()
        start.wait()
        began = time.time()
        for messages in batches:
            futures = [await js.publish_async(s, b, headers=h, stream=stream) for s, b, h in messages]
            await asyncio.gather(*futures)
        await nc.close()
        return began

    began = asyncio.run(publish())
    conn.send((began, time.time(), events))


def _processes(target: Any, args_of: list[tuple[Any, ...]]) -> list[Any]:
    """Run `target(conn, *args, start)` in one process per args, started together; what each sent (its
    (began, ended, n), then anything more)."""
    context = multiprocessing.get_context("fork")
    start = context.Barrier(len(args_of))
    pipes, procs = [], []
    for args in args_of:
        parent, child = context.Pipe(duplex=False)
        proc = context.Process(target=target, args=(child, *args, start), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    results = []
    for pipe, proc in zip(pipes, procs, strict=True):
        try:
            results.append(pipe.recv())
        except EOFError:
            proc.join()
            raise RuntimeError(f"a benchmark process died (exit code {proc.exitcode})") from None
        proc.join()
    return results


def _rate(results: list[tuple[float, float, int]]) -> float:
    return sum(n for _, _, n in results) / (max(e for _, e, _ in results) - min(b for b, _, _ in results))


def _make_stream(servers: str, name: str) -> str:
    url = f"{servers}/{name}?partitions={PARTITIONS}"
    open_store(url, create=True).close()
    return url


def _drop_stream(url: str) -> None:
    store = open_store(url)
    assert isinstance(store, NatsStore)
    store.delete_stream()
    store.close()


# -- (b) consume ---------------------------------------------------------------------------------------------


def _worker(
    conn: Connection, url: str, partitions: list[int], service: str, last_seq: int, now: float, start: Any
) -> None:
    from kvledger.ledger.fleet import run_worker

    store = open_store(url)
    assert isinstance(store, NatsStore)
    start.wait()
    began = time.time()
    caught: list[float] = []

    def between(folds: dict[int, Any], delivered: list[Any]) -> bool:
        if all(f.upto >= last_seq for f in folds.values()):
            caught.append(time.time())
            return False
        return True

    folds = run_worker(store, partitions, service=service, between=between)
    answers = [msgspec.msgpack.encode(f.answer(now, upto=last_seq)) for f in folds.values()]
    events = sum(f.folded.events for f in folds.values())
    digest = sum(f.digest for f in folds.values()) & DIGEST_MASK
    conn.send((began, caught[0], events, answers, digest))
    store.close()


def _consume(url: str, workers: int, service: str, last_seq: int, now: float) -> tuple[float, list[bytes], int, int]:
    """(events/s, answers, events folded, digest) of `workers` processes folding every partition."""
    owned = [list(range(w, PARTITIONS, workers)) for w in range(workers)]
    results = _processes(_worker, [(url, partitions, service, last_seq, now) for partitions in owned])
    timed = [(began, caught, n) for began, caught, n, _, _ in results]
    answers = [a for *_, found, _ in results for a in found]
    folded = sum(n for _, _, n in timed)
    digest = sum(d for *_, d in results)
    return _rate(timed), answers, folded, digest & DIGEST_MASK


# -- (c) the service -----------------------------------------------------------------------------------------


def _paced_engine(conn: Connection, url: str, engine: int, rate: float, seconds: float, spill: str, start: Any) -> None:
    mine = engine_events(engine, int(rate * seconds) + 1, clock_start=time.time())
    start.wait()
    began = time.time()
    n = _append_all(url, mine, spill, rate, began + seconds)
    conn.send((began, time.time(), n))


def _probe(url: str, spill: str, stop: threading.Event, appended: dict[str, float]) -> None:
    """A leaked transfer (its deadline already passed) every PROBE_EVERY_S, each appended time noted."""
    store = open_store(url)
    writer = BackgroundWriter(store, spill).start()
    log = EventLog("probe-0/tp0")
    log.subscribe(writer.put)
    n = 0
    while not stop.is_set():
        now = time.time()
        tid = TransferId(f"probe-{n}")
        appended[tid] = now
        log.append(Map(seq=0, ts=now, source="probe-0/tp0", transfer_id=tid, request_id=ReqId(f"probe-req-{n}"),
                       role="producer", mode="read", block_ids=(1_000_000 + n,), deadline=now - 5.0))  # fmt: skip
        n += 1
        stop.wait(PROBE_EVERY_S)
    writer.close(timeout=60)
    store.close()


def _service(servers: str, engines: int, rate: float, seconds: float, tmp: Path, workers: int | None) -> dict[str, Any]:
    """`kvledger serve` over a fresh stream (with `workers` partition workers; None: one process) while the
    engines append at `rate` for `seconds`: the lag and /audit figures."""
    url = _make_stream(servers, f"kvl-bench-svc-{uuid.uuid4().hex[:8]}")
    port = free_loopback_ports(1)[0]
    env = dict(os.environ, KVLEDGER_DB=url)
    fleet = ["--partitions", "all", "--workers", str(workers)] if workers else []
    service = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", "serve", "--db", url, "--port", str(port), *fleet],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        appended: dict[str, float] = {}
        seen: dict[str, float] = {}
        stop = threading.Event()
        spill = tmp / f"probe-spill-{workers}"
        prober = threading.Thread(target=_probe, args=(url, str(spill), stop, appended), daemon=True)
        result: list[Any] = []
        paced = [(url, e, rate / engines, seconds, str(tmp / f"svc-spill-{workers}-{e}")) for e in range(engines)]
        loader = threading.Thread(target=lambda: result.append(_processes(_paced_engine, paced)), daemon=True)
        loader.start()
        prober.start()
        latencies: list[float] = []
        ends = time.time() + seconds
        while True:
            t0 = time.perf_counter()
            with urllib.request.urlopen(f"{base}/audit?code=leak&limit=1000", timeout=30) as response:
                body = json.loads(response.read())
            latencies.append(time.perf_counter() - t0)
            at = time.time()
            for f in body["findings"]:
                tid = f["transfer_id"]
                if tid.startswith("probe-") and tid not in seen:
                    seen[tid] = at
            if at >= ends and not stop.is_set():
                stop.set()
                prober.join()
            if stop.is_set() and (len(seen) >= len(appended) or at >= ends + GRACE_S):
                break
            time.sleep(POLL_EVERY_S)
        loader.join()
    finally:
        service.terminate()
        service.wait(timeout=30)
        _drop_stream(url)
    lags = sorted(seen.get(tid, ends + GRACE_S) - t for tid, t in appended.items())
    latencies.sort()
    return {
        "service_events_per_s": round(_rate(result[0])),
        "lag_p50_s": round(lags[len(lags) // 2], 3),
        "lag_p99_s": round(lags[min(len(lags) - 1, int(len(lags) * 0.99))], 3),
        "audit_p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 2),
        "audit_max_ms": round(1000 * latencies[-1], 2),
        "probes_unseen": len(appended) - len([t for t in appended if t in seen]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--workers", type=int, default=cores())
    parser.add_argument("--events-per-engine", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="The service's load phase")
    parser.add_argument(
        "--load", type=float, default=0.5, help="The service phase's append rate, as a share of capacity"
    )
    parser.add_argument("--nats", default=os.environ.get("KVLEDGER_TEST_NATS_URL", "nats://127.0.0.1:4222"))
    args = parse_args(parser, engines=2, events_per_engine=2_000, rounds=1, seconds=2.0)
    servers = args.nats.rstrip("/")
    tag = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-fleet-") as folder:
        tmp = Path(folder)
        store_best = raw_best = 0.0
        url = ""
        for round_ in range(args.rounds):
            for name in ("raw", "store") if round_ % 2 == 0 else ("store", "raw"):
                stream = f"kvl-bench-{name}-{tag}-{round_}"
                made = _make_stream(servers, stream)
                if name == "raw":
                    rate = _rate(_processes(_raw_engine, [(servers, stream, e, args.events_per_engine)
                                                          for e in range(args.engines)]))  # fmt: skip
                    raw_best = max(raw_best, rate)
                    _drop_stream(made)
                else:
                    spills = [str(tmp / f"spill-{round_}-{e}") for e in range(args.engines)]
                    rate = _rate(_processes(_engine, [(made, e, args.events_per_engine, spills[e])
                                                      for e in range(args.engines)]))  # fmt: skip
                    store_best = max(store_best, rate)
                    if url:
                        _drop_stream(url)
                    url = made
                print(f"round {round_ + 1}: publish {name:5s} {rate:,.0f} events/s", flush=True)
        store = open_store(url)
        assert isinstance(store, NatsStore)
        last_seq = store.last_sequence()
        stored = list(store.read())
        store.close()
        appended = args.engines * args.events_per_engine
        keys = {(e.source, e.seq) for e in stored}
        now = max(e.ts for e in stored)
        one = replay_chunks(batched(stored, 4_096))
        expected = audit(one.state, now)
        rate_1, _, folded_1, digest_1 = _consume(url, 1, f"bench1-{tag}", last_seq, now)
        print(f"consume 1 worker: {rate_1:,.0f} events/s", flush=True)
        rate_p, answers, folded_p, digest_p = _consume(url, args.workers, f"benchp-{tag}", last_seq, now)
        print(f"consume {args.workers} workers: {rate_p:,.0f} events/s", flush=True)
        merged = merge(msgspec.msgpack.decode(a, type=PartitionAnswer) for a in answers)
        digest = _digest(stored)
        lost = (appended - len(keys)) + max(0, len(stored) - folded_p) + max(0, len(stored) - folded_1)
        duplicated = (len(stored) - len(keys)) + max(0, folded_p - len(stored)) + max(0, folded_1 - len(stored))
        same = merged.findings == expected and merged.events == len(stored) and digest_p == digest == digest_1
        _drop_stream(url)
        capacity = min(store_best, rate_1)
        served = _service(servers, args.engines, capacity * args.load, args.seconds, tmp, args.workers)
        print(f"service, {args.workers} partition workers: {served}", flush=True)
        alone = _service(servers, args.engines, capacity * args.load, args.seconds, tmp, None)
        print(f"service, one process: {alone}", flush=True)
    result = {
        "engines": args.engines,
        "events": appended,
        "partitions": PARTITIONS,
        "workers": args.workers,
        "publish_events_per_s": round(store_best),
        "raw_nats_events_per_s": round(raw_best),
        "publish_ratio": round(store_best / raw_best, 3),
        "consume_events_per_s_1": round(rate_1),
        "consume_events_per_s_p": round(rate_p),
        "consume_speedup": round(rate_p / rate_1, 3),
        "lost": lost,
        "duplicated": duplicated,
        "same_findings": same,
        "service_load": args.load,
        **served,
        **{f"{k}_one_process": v for k, v in alone.items()},
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
