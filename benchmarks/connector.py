"""Connector benchmarks: scheduler-hook cost per step at 512 live transfers, and the tcp transport's
throughput against raw pyzmq moving the same bytes in the same run. Prints one JSON line last.

Run: python benchmarks/connector.py (about 15 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file, this file's folder comes first on sys.path and its name would shadow the `connector` package.
_here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]

import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import zmq  # noqa: E402

from connector.config import ConnectorConfig, PeerEngine  # noqa: E402
from connector.params import parse_params  # noqa: E402
from connector.scheduler import SchedulerCore  # noqa: E402
from connector.transports.tcp import TcpTransport  # noqa: E402
from ledger.events import ReqId  # noqa: E402
from ledger.ledger import Ledger  # noqa: E402

LIVE_TRANSFERS = 512
STEPS = 3000
TURNOVER_PER_STEP = 8
BLOCKS_PER_TRANSFER = 16

REGION_BYTES = 64 << 20
OP_BYTES = 1 << 20
ROUNDS = 8
TRIALS = 4
"""Transport and raw runs alternate TRIALS times; each reports its best trial (loopback is noisy)."""


def hook_cost() -> tuple[float, float]:
    """Microseconds per step of the producer scheduler's hooks with LIVE_TRANSFERS held."""
    peer = PeerEngine(host="127.0.0.1", handshake_port=7001, notify_port=7002, transport_port=7003)
    config = ConnectorConfig(role="producer", mode="read", engine_id="prefill-0", peers=(peer,))
    core = SchedulerCore(config, Ledger(config.source(scheduler=True)))
    now = 1000.0
    serial = 0

    def finish_one() -> ReqId:
        nonlocal serial
        serial += 1
        params = parse_params({"transfer_id": f"tx-{serial}", "do_remote_decode": True})
        blocks = range(serial * BLOCKS_PER_TRANSFER, (serial + 1) * BLOCKS_PER_TRANSFER)
        core.on_request_finished(ReqId(f"p-{serial}"), params, blocks, now)
        return ReqId(f"p-{serial}")

    live = [finish_one() for _ in range(LIVE_TRANSFERS)]
    core.build_meta()
    samples: list[float] = []
    for _ in range(STEPS):
        now += 0.01
        released, live = live[:TURNOVER_PER_STEP], live[TURNOVER_PER_STEP:]
        start = time.perf_counter_ns()
        new = [finish_one() for _ in range(TURNOVER_PER_STEP)]
        core.build_meta()
        outcome = core.on_worker_output(released, (), (), now)
        core.has_pending_block_frees()
        core.stats()
        samples.append((time.perf_counter_ns() - start) / 1000)
        assert outcome.finished_sending == set(released)
        live.extend(new)
    assert len(core.state.live) == LIVE_TRANSFERS
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def transport_throughput() -> float:
    a, b = TcpTransport(), TcpTransport()
    try:
        source = torch.randint(0, 255, (REGION_BYTES,), dtype=torch.uint8)
        target = torch.zeros(REGION_BYTES, dtype=torch.uint8)
        remote = a.register("kv", source)
        b.register("kv", target)
        session = b.connect(a.endpoint(), [remote])
        ops = [(off, off, OP_BYTES) for off in range(0, REGION_BYTES, OP_BYTES)]
        handle = b.read(session, "kv", "kv", ops)  # warm-up: connect, page in
        assert handle.wait(30) and handle.status().succeeded()
        start = time.perf_counter()
        for _ in range(ROUNDS):
            handle = b.read(session, "kv", "kv", ops)
            assert handle.wait(30) and handle.status().succeeded(), handle.status()
        elapsed = time.perf_counter() - start
        assert torch.equal(source, target)
        return REGION_BYTES * ROUNDS / elapsed
    finally:
        a.close()
        b.close()


def raw_zmq_throughput() -> float:
    """The same bytes, the same request/reply shape (DEALER asks, ROUTER answers with one frame per op),
    each frame received into a destination buffer as the transport does (recv_into: one copy)."""
    context: zmq.Context[Any] = zmq.Context()
    source = torch.randint(0, 255, (REGION_BYTES,), dtype=torch.uint8).numpy()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        frames_out = [source[off : off + OP_BYTES].data for off in range(0, REGION_BYTES, OP_BYTES)]
        while not stop.is_set():
            if server.poll(50):
                identity, _ = server.recv_multipart()
                server.send_multipart([identity, b"ok", *frames_out], copy=False)
        server.close(linger=0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{port}")
    target = torch.zeros(REGION_BYTES, dtype=torch.uint8).numpy()

    def receive() -> int:
        client.recv()  # the reply header
        received = 0
        while client.getsockopt(zmq.RCVMORE):
            received += client.recv_into(target[received : received + OP_BYTES].data)
        return received

    try:
        client.send(b"read")
        receive()
        start = time.perf_counter()
        for _ in range(ROUNDS):
            client.send(b"read")
            assert receive() == REGION_BYTES
        elapsed = time.perf_counter() - start
        assert (target == source).all()
    finally:
        stop.set()
        thread.join(2)
        client.close(linger=0)
        context.term()
    return REGION_BYTES * ROUNDS / elapsed


def main() -> None:
    median_us, p99_us = hook_cost()
    print(f"scheduler hooks per step at {LIVE_TRANSFERS} live: median {median_us:.1f} us, p99 {p99_us:.1f} us")
    raw_trials, moved_trials = [], []
    for _ in range(TRIALS):
        raw_trials.append(raw_zmq_throughput())
        moved_trials.append(transport_throughput())
    raw, moved = max(raw_trials), max(moved_trials)
    print(f"tcp transport {moved / 1e9:.2f} GB/s, raw pyzmq {raw / 1e9:.2f} GB/s, ratio {moved / raw:.2f}")
    print(
        json.dumps(
            {
                "hook_us_median": round(median_us, 2),
                "hook_us_p99": round(p99_us, 2),
                "live_transfers": LIVE_TRANSFERS,
                "transport_bytes_per_s": round(moved),
                "raw_zmq_bytes_per_s": round(raw),
                "transport_ratio": round(moved / raw, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
