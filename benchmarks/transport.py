"""The tcp transport's throughput on KV blocks against raw pyzmq moving the same bytes from host memory, in the
same run: for CPU tensors (the zero-copy path), for CPU tensors forced through the device path's staging, and,
where torch sees CUDA, for CUDA tensors (staged: one gather, one copy and one sync per request).

Each round is a READ of the same blocks of every layer (one request per layer, all issued, then waited for, as
the worker issues them): the serving side gathers and sends, the reading side receives and scatters, so both
staging directions are timed. The `_write` figures move the same blocks the other way as WRITE mode does: one
push a layer, all issued, then waited for (on a staged region, layer n+1 is gathered and copied while layer n
is on the wire). The baseline is the same ops as frames between a DEALER and a ROUTER from numpy
arrays (zero-copy sends, recv_into a destination: one copy), pipelined the same way. Each figure is the best of
TRIALS (a shared machine slows runs, never speeds them). `bytes_equal`: every run's destination blocks equal
their source blocks, byte for byte, and no other block changed. The cuda fields are null without CUDA.
Targets: ratio_cpu >= 1.0, ratio_cuda >= 0.8 (the ratios are all to the same raw pyzmq figure).

Run: python benchmarks/transport.py [--quick]   (--quick: a few seconds, 4 MiB a round)
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file, this file's folder comes first on sys.path and its name would shadow the `connector` package.
_here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import zmq  # noqa: E402

from kvledger.connector.layout import block_ops, geometry_of  # noqa: E402
from kvledger.connector.transports.base import Op  # noqa: E402
from kvledger.connector.transports.tcp import TcpTransport  # noqa: E402

FIELDS: tuple[str, ...] = (
    "tcp_gb_s_cpu",
    "tcp_staged_gb_s_cpu",
    "raw_zmq_gb_s",
    "ratio_cpu",
    "ratio_staged_cpu",
    "tcp_gb_s_cuda",
    "ratio_cuda",
    "tcp_gb_s_cpu_write",
    "ratio_cpu_write",
    "tcp_staged_gb_s_cpu_write",
    "ratio_staged_cpu_write",
    "tcp_gb_s_cuda_write",
    "ratio_cuda_write",
    "bytes_equal",
    "layers",
    "blocks",
    "block_bytes",
    "round_bytes",
)
WAIT_S = 120.0
BLOCK_SHAPE = (16, 8, 64)
"""Tokens, KV heads, head size of one block's K (and V): 16 KiB of fp16 each, 32 KiB a block."""


@dataclass(frozen=True)
class Size:
    layers: int
    blocks: int
    rounds: int
    trials: int


FULL = Size(layers=16, blocks=128, rounds=4, trials=3)
"""64 MiB a round (16 layers x 128 blocks x 32 KiB): a long prompt's KV on a small model."""
QUICK = Size(layers=4, blocks=32, rounds=2, trials=2)


def caches(size: Size, device: str, seed: int) -> list[torch.Tensor]:
    """One K/V-split cache a layer, (2, blocks, tokens, heads, head size), twice the blocks read."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 2 * size.blocks, *BLOCK_SHAPE)
    return [
        torch.randint(0, 250, shape, generator=generator, dtype=torch.uint8).half().to(device)
        for _ in range(size.layers)
    ]


def read_ops(size: Size, cache: torch.Tensor) -> list[Op]:
    """The blocks read: every other block of the source into the first blocks of the target (no runs merge
    on the source side: one op per block and half, as a fragmented KV cache gives)."""
    geometry = geometry_of(cache, 2 * size.blocks)
    return block_ops(geometry, geometry, list(range(size.blocks)), list(range(0, 2 * size.blocks, 2)))


def moved_as_expected(size: Size, sources: list[torch.Tensor], targets: list[torch.Tensor], seed: int) -> bool:
    untouched = caches(size, "cpu", seed)
    for source, target, before in zip(sources, targets, untouched, strict=True):
        target, source = target.cpu(), source.cpu()
        if not torch.equal(target[:, : size.blocks], source[:, 0 : 2 * size.blocks : 2]):
            return False
        if not torch.equal(target[:, size.blocks :], before[:, size.blocks :]):
            return False
    return True


def tcp_bytes_per_s(size: Size, device: str, *, staged: bool, write: bool = False) -> tuple[float, bool]:
    """b reads a's source blocks into its own (or, `write`, pushes its source blocks into a's), layer by layer."""
    a = TcpTransport("127.0.0.1", 0, stage_host_regions=staged)
    b = TcpTransport("127.0.0.1", 0, stage_host_regions=staged)
    try:
        sources, targets = caches(size, device, 1), caches(size, device, 2)
        remote, local = (targets, sources) if write else (sources, targets)
        descriptors = [a.register(f"layer.{i}", tensor) for i, tensor in enumerate(remote)]
        for i, tensor in enumerate(local):
            b.register(f"layer.{i}", tensor)
        session = b.connect(a.endpoint(), descriptors)
        ops = read_ops(size, sources[0])
        if write:  # the same blocks, from b's source into a's target: local and remote offsets swap
            ops = [(ro, lo, n) for lo, ro, n in ops]
        move = b.write if write else b.read
        round_bytes = size.layers * sum(op[2] for op in ops)

        def one_round() -> None:
            handles = [move(session, f"layer.{i}", f"layer.{i}", ops) for i in range(size.layers)]
            assert b.wait_all(handles, WAIT_S), "a request did not finish"
            for handle in handles:
                assert handle.status().succeeded(), handle.status()

        one_round()  # warm-up: connections, staging buffers, page-ins
        if device == "cuda":
            torch.cuda.synchronize()  # the caches' creation; a request's own copies are synchronised by it
        started = time.perf_counter()
        for _ in range(size.rounds):
            one_round()
        elapsed = time.perf_counter() - started
        return round_bytes * size.rounds / elapsed, moved_as_expected(size, sources, targets, 2)
    finally:
        a.close()
        b.close()


def raw_zmq_bytes_per_s(size: Size) -> tuple[float, bool]:
    """The same ops' bytes as frames from host numpy arrays: a ROUTER answers each layer's request with one
    zero-copy frame per op, the DEALER receives each into its destination (recv_into)."""
    sources, targets = caches(size, "cpu", 1), caches(size, "cpu", 2)
    ops = read_ops(size, sources[0])
    source_bytes = [s.view(-1).view(torch.uint8).numpy() for s in sources]
    target_bytes = [t.view(-1).view(torch.uint8).numpy() for t in targets]
    context: zmq.Context[Any] = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        replies = [[b"ok", *(array[ro : ro + n].data for _, ro, n in ops)] for array in source_bytes]
        while not stop.is_set():
            if server.poll(50):
                identity, layer = server.recv_multipart()
                server.send_multipart([identity, *replies[int(layer)]], copy=False)
        server.close(linger=0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{port}")

    def one_round() -> None:
        for layer in range(size.layers):
            client.send(str(layer).encode())
        for layer in range(size.layers):  # one connection, one server thread: replies in request order
            client.recv()
            array = target_bytes[layer]
            for lo, _, n in ops:
                assert client.getsockopt(zmq.RCVMORE)
                assert client.recv_into(array[lo : lo + n].data) == n

    try:
        one_round()
        started = time.perf_counter()
        for _ in range(size.rounds):
            one_round()
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        thread.join(2)
        client.close(linger=0)
        context.term()
    round_bytes = size.layers * sum(op[2] for op in ops)
    return round_bytes * size.rounds / elapsed, moved_as_expected(size, sources, targets, 2)


def best(trials: list[tuple[float, bool]]) -> tuple[float, bool]:
    return max(rate for rate, _ in trials), all(equal for _, equal in trials)


def gb_s(rate: float | None) -> float | None:
    return None if rate is None else round(rate / 1e9, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds (CI)")
    size = QUICK if parser.parse_args().quick else FULL
    kinds: dict[str, Callable[[], tuple[float, bool]]] = {
        "raw": lambda: raw_zmq_bytes_per_s(size),
        "cpu": lambda: tcp_bytes_per_s(size, "cpu", staged=False),
        "staged": lambda: tcp_bytes_per_s(size, "cpu", staged=True),
        "cpu_write": lambda: tcp_bytes_per_s(size, "cpu", staged=False, write=True),
        "staged_write": lambda: tcp_bytes_per_s(size, "cpu", staged=True, write=True),
    }
    if torch.cuda.is_available():
        kinds["cuda"] = lambda: tcp_bytes_per_s(size, "cuda", staged=True)
        kinds["cuda_write"] = lambda: tcp_bytes_per_s(size, "cuda", staged=True, write=True)
    runs: dict[str, list[tuple[float, bool]]] = {kind: [] for kind in kinds}
    for _ in range(size.trials):  # interleaved, so a burst of load elsewhere slows each kind alike
        for kind, run in kinds.items():
            runs[kind].append(run())
    rates = {kind: best(trials)[0] for kind, trials in runs.items()}
    bytes_equal = all(best(trials)[1] for trials in runs.values())
    raw = rates["raw"]

    def ratio(kind: str) -> float | None:
        return round(rates[kind] / raw, 3) if kind in rates else None

    ops = read_ops(size, caches(Size(1, size.blocks, 1, 1), "cpu", 0)[0])
    block_bytes = 2 * ops[0][2]
    print(
        f"raw pyzmq {raw / 1e9:.2f} GB/s; tcp ratios to it, read / write: CPU tensors {ratio('cpu')} / "
        f"{ratio('cpu_write')}, CPU tensors staged {ratio('staged')} / {ratio('staged_write')}, CUDA tensors "
        + (f"{ratio('cuda')} / {ratio('cuda_write')}" if "cuda" in rates else "n/a (no CUDA here)")
    )
    print(
        json.dumps(
            {
                "tcp_gb_s_cpu": gb_s(rates["cpu"]),
                "tcp_staged_gb_s_cpu": gb_s(rates["staged"]),
                "raw_zmq_gb_s": gb_s(raw),
                "ratio_cpu": ratio("cpu"),
                "ratio_staged_cpu": ratio("staged"),
                "tcp_gb_s_cuda": gb_s(rates.get("cuda")),
                "ratio_cuda": ratio("cuda"),
                "tcp_gb_s_cpu_write": gb_s(rates["cpu_write"]),
                "ratio_cpu_write": ratio("cpu_write"),
                "tcp_staged_gb_s_cpu_write": gb_s(rates["staged_write"]),
                "ratio_staged_cpu_write": ratio("staged_write"),
                "tcp_gb_s_cuda_write": gb_s(rates.get("cuda_write")),
                "ratio_cuda_write": ratio("cuda_write"),
                "bytes_equal": bytes_equal,
                "layers": size.layers,
                "blocks": size.blocks,
                "block_bytes": block_bytes,
                "round_bytes": size.layers * size.blocks * block_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
